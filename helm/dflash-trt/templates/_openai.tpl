{{/*
The OpenAI-compatible front (docs/serving.md): a sidecar of the serving pod that runs
`dflash-trt serve --triton-url 127.0.0.1:8001` and forwards /v1/completions and
/v1/chat/completions to Triton over gRPC. With apiKey.secretName it reads the key from
$DFLASH_TRT_API_KEY: clients send it as `Authorization: Bearer`, and it sends it to Triton. Readiness is /health (Triton and the model ready),
liveness /health/live (the front itself). Included by dflash-trt.podTemplate when openai.enabled.
*/}}
{{- define "dflash-trt.openaiContainer" -}}
{{- $v := .Values -}}
- name: openai
  {{- if $v.openai.image.repository }}
  image: {{ include "dflash-trt.image" (dict "repository" $v.openai.image.repository "tag" ($v.openai.image.tag | default $v.image.tag) "digest" "") }}
  {{- else }}
  image: {{ include "dflash-trt.image" $v.image }}
  {{- end }}
  imagePullPolicy: {{ $v.openai.image.pullPolicy }}
  command:
    - dflash-trt
    - serve
  args:
    - --bundle
    - {{ $v.bundle.mountPath | quote }}
    - --triton-url
    - "127.0.0.1:8001"
    - --host
    - "0.0.0.0"
    - --openai-port
    - {{ int $v.openai.port | quote }}
    {{- with $v.openai.modelName }}
    - --openai-model-name
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "dflash-trt.commonEnv" . | nindent 4 }}
    {{- if $v.apiKey.secretName }}
    {{- include "dflash-trt.apiKeyEnv" . | nindent 4 }}
    {{- end }}
  ports:
    - name: openai
      containerPort: {{ int $v.openai.port }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /health
      port: openai
    periodSeconds: {{ int $v.probes.readiness.periodSeconds }}
    timeoutSeconds: {{ int $v.probes.readiness.timeoutSeconds }}
    failureThreshold: {{ int $v.probes.readiness.failureThreshold }}
  livenessProbe:
    httpGet:
      path: /health/live
      port: openai
    periodSeconds: {{ int $v.probes.liveness.periodSeconds }}
    timeoutSeconds: {{ int $v.probes.liveness.timeoutSeconds }}
    failureThreshold: {{ int $v.probes.liveness.failureThreshold }}
  {{- with $v.openai.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: bundle
      mountPath: {{ $v.bundle.mountPath }}
      {{- with $v.storage.subPath }}
      subPath: {{ . }}
      {{- end }}
      readOnly: true
{{- end -}}
