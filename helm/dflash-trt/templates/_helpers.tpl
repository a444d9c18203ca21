{{/*
Names. Kubernetes names are DNS labels (63 characters). LeaderWorkerSet pods are named
<lws>-<group>-<worker> and their StatefulSets <lws>-<group>, whose pods carry a
controller-revision-hash label of <sts>-<10 chars>, so the LWS name is kept to 45 characters.
*/}}
{{- define "dflash-trt.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dflash-trt.fullname" -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- $full := .Values.fullnameOverride | default (ternary .Release.Name (printf "%s-%s" .Release.Name $name) (contains $name .Release.Name)) -}}
{{- $full | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dflash-trt.lwsName" -}}
{{- include "dflash-trt.fullname" . | trunc 45 | trimSuffix "-" -}}
{{- end -}}

{{- define "dflash-trt.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dflash-trt.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dflash-trt.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dflash-trt.labels" -}}
helm.sh/chart: {{ include "dflash-trt.chart" . }}
{{ include "dflash-trt.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dflash-trt
{{- end -}}

{{/* The pods that serve requests: `server` (Deployment) or `leader` (LWS). */}}
{{- define "dflash-trt.servingComponent" -}}
{{- ternary "leader" "server" .Values.multiNode.enabled -}}
{{- end -}}

{{- define "dflash-trt.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dflash-trt.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "dflash-trt.image" -}}
{{- .repository -}}{{- with .tag -}}:{{ . }}{{- end -}}{{- with .digest -}}@{{ . }}{{- end -}}
{{- end -}}

{{/*
An image with dflash-trt installed, for containers that run `dflash-trt build` without an image of
their own: the server image for backend=torch (build/docker/Dockerfile.serve-torch), the build image
for backend=trtllm (build/docker/Dockerfile.build-trtllm: dflash-trt and ModelOpt on the NGC
TensorRT-LLM image), since the NGC server image has no dflash-trt.
*/}}
{{- define "dflash-trt.dflashImage" -}}
{{- if eq .Values.backend "torch" -}}
{{- include "dflash-trt.image" .Values.image -}}
{{- else -}}
{{- printf "ghcr.io/dflash-trt/dflash-trt-build:%s-trtllm" .Chart.AppVersion -}}
{{- end -}}
{{- end -}}

{{/*
API key (apiKey.secretName): every Triton endpoint group but `health` needs `authorization: Bearer
<key>` (gRPC metadata `triton-grpc-protocol-authorization`); probes and the metrics port stay open.
Kubernetes expands $(DFLASH_TRT_API_KEY) from the container's environment, so the pod spec names only
the Secret. The groups are dflash_trt.triton.server.PROTECTED_APIS plus model-repository (tests check).
*/}}
{{- define "dflash-trt.apiKeyGroups" -}}inference,metadata,model-config,statistics,shared-memory,trace,logging,model-repository{{- end -}}

{{- define "dflash-trt.apiKeyEnv" -}}
- name: DFLASH_TRT_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.secretName }}
      key: {{ .Values.apiKey.secretKey }}
{{- end -}}

{{/* GPUs on each pod: the whole replica on one node, or one node's worth per LWS pod. */}}
{{- define "dflash-trt.gpusPerPod" -}}
{{- if .Values.multiNode.enabled -}}
{{- int .Values.gpu.perNode -}}
{{- else -}}
{{- int .Values.gpu.count -}}
{{- end -}}
{{- end -}}

{{/* Pods per LWS group. */}}
{{- define "dflash-trt.groupSize" -}}
{{- div (int .Values.gpu.count) (int .Values.gpu.perNode) -}}
{{- end -}}

{{- define "dflash-trt.repositoryPath" -}}
{{- printf "%s/%s" (include "dflash-trt.bundlePath" .) .Values.bundle.repositorySubPath -}}
{{- end -}}

{{- define "dflash-trt.hfHome" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.bundle.mountPath) .Values.bundle.hfCacheSubPath -}}
{{- end -}}

{{- define "dflash-trt.claimName" -}}
{{- if eq .Values.storage.type "existingClaim" -}}
{{- .Values.storage.existingClaim -}}
{{- else -}}
{{- printf "%s-bundle" (include "dflash-trt.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
Shutdown timing, all derived from server.drainSeconds (plus the preStop sleep):
  preStop:  sleep server.preStopSleepSeconds (endpoints and load balancers forget the pod), then ask
            the model to drain (DFLASH_TRT_CONTROL_DIR/drain holds drainSeconds) and wait for its
            `drained` marker, at most drainSeconds + 15 s
  SIGTERM:  tritonserver has exitTimeoutSeconds to close idle connections and finalize the model
  SIGKILL:  terminationGracePeriodSeconds = preStop sleep + drainSeconds + 15 + exit timeout + 5
*/}}
{{- define "dflash-trt.exitTimeoutSeconds" -}}10{{- end -}}
{{- define "dflash-trt.terminationGracePeriodSeconds" -}}
{{- add (int .Values.server.preStopSleepSeconds) (int .Values.server.drainSeconds) 15 (include "dflash-trt.exitTimeoutSeconds" . | int) 5 -}}
{{- end -}}
{{- define "dflash-trt.controlDir" -}}/var/run/dflash-trt{{- end -}}

{{/* The tritonserver arguments shared by the single-node server and the multi-node leader. */}}
{{- define "dflash-trt.tritonArgs" -}}
- --model-repository={{ include "dflash-trt.repositoryPath" . }}
- --http-port=8000
- --grpc-port=8001
- --metrics-port=8002
- --allow-metrics=true
- --log-verbose={{ int .Values.server.logVerbose }}
- --exit-timeout-secs={{ include "dflash-trt.exitTimeoutSeconds" . }}
{{- if .Values.apiKey.secretName }}
- --http-restricted-api={{ include "dflash-trt.apiKeyGroups" . }}:authorization=Bearer $(DFLASH_TRT_API_KEY)
- --grpc-restricted-protocol={{ include "dflash-trt.apiKeyGroups" . }}:authorization=Bearer $(DFLASH_TRT_API_KEY)
{{- end }}
{{- range .Values.server.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Environment shared by every container that touches the bundle volume. */}}
{{- define "dflash-trt.commonEnv" -}}
- name: DFLASH_TRT_CONTROL_DIR
  value: {{ include "dflash-trt.controlDir" . | quote }}
- name: HF_HOME
  value: {{ include "dflash-trt.hfHome" . | quote }}
{{- if .Values.hfToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.secretName }}
      key: {{ .Values.hfToken.secretKey }}
{{- end }}
{{- end -}}

{{- define "dflash-trt.gpuResources" -}}
{{- $gpus := include "dflash-trt.gpusPerPod" . | int -}}
{{- $res := deepCopy (.Values.resources | default dict) -}}
{{- if gt $gpus 0 -}}
{{- $requests := get $res "requests" | default dict -}}
{{- $limits := get $res "limits" | default dict -}}
{{- $_ := set $requests .Values.gpu.resourceName $gpus -}}
{{- $_ = set $limits .Values.gpu.resourceName $gpus -}}
{{- $_ = set $res "requests" $requests -}}
{{- $_ = set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Node affinity on nvidia.com/gpu.product, merged with user affinity. */}}
{{- define "dflash-trt.affinity" -}}
{{- $aff := deepCopy (.Values.affinity | default dict) -}}
{{- if and .Values.gpu.product (gt (int .Values.gpu.count) 0) -}}
{{- $expr := dict "key" "nvidia.com/gpu.product" "operator" "In" "values" .Values.gpu.product -}}
{{- $node := get $aff "nodeAffinity" | default dict -}}
{{- $req := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default dict -}}
{{- $terms := get $req "nodeSelectorTerms" | default list -}}
{{- if $terms -}}
{{- /* Node selector terms are ORed; the GPU product must hold in each of them. */ -}}
{{- $merged := list -}}
{{- range $terms -}}
{{- $t := deepCopy . -}}
{{- $_ := set $t "matchExpressions" (append (get $t "matchExpressions" | default list) $expr) -}}
{{- $merged = append $merged $t -}}
{{- end -}}
{{- $terms = $merged -}}
{{- else -}}
{{- $terms = list (dict "matchExpressions" (list $expr)) -}}
{{- end -}}
{{- $_ := set $req "nodeSelectorTerms" $terms -}}
{{- $_ = set $node "requiredDuringSchedulingIgnoredDuringExecution" $req -}}
{{- $_ = set $aff "nodeAffinity" $node -}}
{{- end -}}
{{- if $aff -}}{{- toYaml $aff -}}{{- end -}}
{{- end -}}

{{- define "dflash-trt.tolerations" -}}
{{- $tols := .Values.tolerations | default list -}}
{{- if and .Values.gpu.tolerateGpuTaint (gt (int .Values.gpu.count) 0) -}}
{{- $tols = append $tols (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") -}}
{{- end -}}
{{- if $tols -}}{{- toYaml $tols -}}{{- end -}}
{{- end -}}

{{/* A fingerprint of the init spec: a changed spec reruns the init container on the same volume. */}}
{{- define "dflash-trt.initFingerprint" -}}
{{- dict "mode" .Values.modelInit.mode "download" .Values.modelInit.download "build" .Values.modelInit.build | toJson | sha256sum | trunc 12 -}}
{{- end -}}
