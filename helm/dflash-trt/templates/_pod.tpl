{{/*
The pod template shared by the Deployment (role `server`) and the LeaderWorkerSet (roles
`leader` and `worker`). Call with (dict "root" $ "role" "<role>").
*/}}
{{- define "dflash-trt.podTemplate" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $v := $root.Values -}}
{{- $gpus := include "dflash-trt.gpusPerPod" $root | int -}}
metadata:
  labels:
    {{- include "dflash-trt.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $role }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- if $v.bundle.name }}
    dflash-trt/bundle: {{ $v.bundle.name | quote }}
    {{- end }}
    dflash-trt/backend: {{ $v.backend | quote }}
    {{- if and $v.metrics.podAnnotations (ne $role "worker") }}
    prometheus.io/scrape: "true"
    prometheus.io/port: "8002"
    prometheus.io/path: /metrics
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "dflash-trt.serviceAccountName" $root }}
  automountServiceAccountToken: {{ $v.serviceAccount.automountToken }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ include "dflash-trt.terminationGracePeriodSeconds" $root }}
  {{- with $v.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "dflash-trt.affinity" $root }}
  affinity:
    {{- . | nindent 4 }}
  {{- end }}
  {{- with include "dflash-trt.tolerations" $root }}
  tolerations:
    {{- . | nindent 4 }}
  {{- end }}
  {{- with $v.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if or $v.modelInit.enabled $v.buildJob.enabled }}
  initContainers:
  {{- if $v.buildJob.enabled }}
    {{- include "dflash-trt.waitForBundle" $root | nindent 4 }}
  {{- end }}
  {{- if $v.modelInit.enabled }}
    - name: model-init
      {{- if $v.modelInit.image.repository }}
      image: {{ include "dflash-trt.image" (dict "repository" $v.modelInit.image.repository "tag" ($v.modelInit.image.tag | default $v.image.tag) "digest" "") }}
      {{- else if eq $v.modelInit.mode "build" }}
      image: {{ include "dflash-trt.dflashImage" $root }}
      {{- else }}
      image: {{ include "dflash-trt.image" $v.image }}
      {{- end }}
      imagePullPolicy: {{ $v.modelInit.image.pullPolicy }}
      {{- $marker := printf "%s/.dflash-trt-init-%s.done" (trimSuffix "/" $v.bundle.mountPath) (include "dflash-trt.initFingerprint" $root) }}
      command:
        - /bin/sh
        - -c
        - |
          set -eu
          marker={{ squote $marker }}
          if [ -f "$marker" ]; then
            echo "model-init: $marker exists, the volume is ready"
            exit 0
          fi
          {{- if eq $v.modelInit.mode "download" }}
          {{- range $v.modelInit.download.repos }}
          echo "model-init: downloading {{ .repo }}"
          hf download {{ squote .repo }}{{ with .revision }} --revision {{ squote . }}{{ end }}{{ with .localDir }} --local-dir {{ squote . }}{{ end }}
          {{- end }}
          {{- else }}
          echo "model-init: dflash-trt build $*"
          dflash-trt build "$@"
          if [ ! -d {{ squote (include "dflash-trt.repositoryPath" $root) }} ]; then
            echo "model-init: dflash-trt build wrote no {{ include "dflash-trt.repositoryPath" $root }}; fix: make modelInit.build.args write the bundle to {{ $v.bundle.mountPath }}" >&2
            exit 1
          fi
          {{- end }}
          touch "$marker"
        - model-init
      {{- if eq $v.modelInit.mode "build" }}
      args:
        {{- range $v.modelInit.build.args }}
        - {{ . | quote }}
        {{- end }}
      {{- end }}
      env:
        {{- include "dflash-trt.commonEnv" $root | nindent 8 }}
        {{- with $v.modelInit.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- $initRes := deepCopy ($v.modelInit.resources | default dict) }}
      {{- if and $v.modelInit.useGpus (gt $gpus 0) }}
      {{- $_ := set $initRes "limits" (merge (dict $v.gpu.resourceName $gpus) (get $initRes "limits" | default dict)) }}
      {{- $_ = set $initRes "requests" (merge (dict $v.gpu.resourceName $gpus) (get $initRes "requests" | default dict)) }}
      {{- end }}
      {{- with $initRes }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: bundle
          mountPath: {{ $v.bundle.mountPath }}
          {{- with $v.storage.subPath }}
          subPath: {{ . }}
          {{- end }}
  {{- end }}
  {{- end }}
  containers:
    - name: {{ ternary "worker" "triton" (eq $role "worker") }}
      image: {{ include "dflash-trt.image" $v.image }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- if eq $role "worker" }}
      {{- if $v.multiNode.workerCommand }}
      command:
        {{- toYaml $v.multiNode.workerCommand | nindent 8 }}
      {{- else }}
      # Workers only host MPI ranks: mpirun on the leader reaches them through this sshd.
      command:
        - /bin/bash
        - -c
        - |
          set -euo pipefail
          install -d -m 700 /tmp/ssh
          install -m 600 /etc/dflash-trt/ssh/id_ed25519 /tmp/ssh/host_key
          exec /usr/sbin/sshd -D -e -p {{ int $v.multiNode.sshPort }} -h /tmp/ssh/host_key \
            -o AuthorizedKeysFile=/etc/dflash-trt/ssh/authorized_keys -o StrictModes=no \
            -o PasswordAuthentication=no -o KbdInteractiveAuthentication=no -o UsePAM=no \
            -o PidFile=/tmp/ssh/sshd.pid
      {{- end }}
      {{- else if eq $role "leader" }}
      {{- if $v.multiNode.leaderCommand }}
      command:
        {{- toYaml $v.multiNode.leaderCommand | nindent 8 }}
      {{- else }}
      # mpirun starts gpu.perNode ranks on every pod of the group; trtllm-llmapi-launch runs
      # tritonserver on rank 0 and turns the other ranks into TensorRT-LLM workers.
      command:
        - /bin/bash
        - -c
        - |
          set -euo pipefail
          mpi_extra=()
          while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do mpi_extra+=("$1"); shift; done
          shift
          install -d -m 700 /tmp/ssh
          install -m 600 /etc/dflash-trt/ssh/id_ed25519 /tmp/ssh/id_ed25519
          ssh_opts="-p {{ int $v.multiNode.sshPort }} -i /tmp/ssh/id_ed25519 -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
          leader="${LWS_LEADER_ADDRESS%%.*}"
          domain="${LWS_LEADER_ADDRESS#*.}"
          hosts="${LWS_LEADER_ADDRESS}:{{ int $v.gpu.perNode }}"
          deadline=$((SECONDS + {{ int $v.multiNode.workerWaitSeconds }}))
          for i in $(seq 1 $((LWS_GROUP_SIZE - 1))); do
            host="${leader}-${i}.${domain}"
            until ssh $ssh_opts "$host" true; do
              if [ "$SECONDS" -ge "$deadline" ]; then
                echo "leader: worker $host has no sshd on port {{ int $v.multiNode.sshPort }} after {{ int $v.multiNode.workerWaitSeconds }}s" >&2
                exit 1
              fi
              sleep 5
            done
            hosts="${hosts},${host}:{{ int $v.gpu.perNode }}"
          done
          echo "leader: mpirun over $hosts"
          exec mpirun --allow-run-as-root -np $((LWS_GROUP_SIZE * {{ int $v.gpu.perNode }})) -H "$hosts" \
            --mca plm_rsh_args "$ssh_opts" \
            -x PATH -x LD_LIBRARY_PATH -x HF_HOME -x DFLASH_TRT_CONTROL_DIR{{ if $v.hfToken.secretName }} -x HF_TOKEN{{ end }} \
            "${mpi_extra[@]}" \
            trtllm-llmapi-launch tritonserver "$@"
        - leader
      args:
        {{- range $v.multiNode.mpirunExtraArgs }}
        - {{ . | quote }}
        {{- end }}
        - "--"
        {{- include "dflash-trt.tritonArgs" $root | nindent 8 }}
      {{- end }}
      {{- else if $v.server.command }}
      command:
        {{- toYaml $v.server.command | nindent 8 }}
      {{- else }}
      command:
        - tritonserver
      args:
        {{- include "dflash-trt.tritonArgs" $root | nindent 8 }}
      {{- end }}
      env:
        {{- include "dflash-trt.commonEnv" $root | nindent 8 }}
        {{- if and (ne $role "worker") $v.apiKey.secretName }}
        {{- include "dflash-trt.apiKeyEnv" $root | nindent 8 }}
        {{- end }}
        {{- with $v.server.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.server.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if eq $role "worker" }}
      ports:
        - name: ssh
          containerPort: {{ int $v.multiNode.sshPort }}
          protocol: TCP
      readinessProbe:
        tcpSocket:
          port: ssh
        periodSeconds: 10
      livenessProbe:
        tcpSocket:
          port: ssh
        periodSeconds: 30
        failureThreshold: 4
      {{- else }}
      ports:
        - name: http
          containerPort: 8000
          protocol: TCP
        - name: grpc
          containerPort: 8001
          protocol: TCP
        - name: metrics
          containerPort: 8002
          protocol: TCP
      {{- with $v.probes.startup }}
      # Liveness and readiness start only after this succeeds: a slow weights load is not a crash.
      startupProbe:
        httpGet:
          path: /v2/health/ready
          port: http
        periodSeconds: {{ int .periodSeconds }}
        timeoutSeconds: {{ int .timeoutSeconds }}
        failureThreshold: {{ div (add (int .budgetSeconds) (int .periodSeconds) -1) (int .periodSeconds) }}
      {{- end }}
      {{- with $v.probes.readiness }}
      # Triton keeps answering ready after the model's engine died (its thread raised or wedged; every
      # request then gets UNAVAILABLE), so readiness also asks for no engine-dead report from the model.
      readinessProbe:
        exec:
          command:
            - /bin/bash
            - -c
            - |
              dead={{ include "dflash-trt.controlDir" $root }}/engine-dead
              if [ -e "$dead" ]; then echo "the model's engine is dead: $(head -c 300 "$dead")" >&2; exit 1; fi
              exec 3<>/dev/tcp/127.0.0.1/8000 || exit 1
              printf 'GET /v2/health/ready HTTP/1.0\r\n\r\n' >&3
              head -n 1 <&3 | grep -q ' 200 ' || { echo "/v2/health/ready is not 200" >&2; exit 1; }
        periodSeconds: {{ int .periodSeconds }}
        timeoutSeconds: {{ int .timeoutSeconds }}
        failureThreshold: {{ int .failureThreshold }}
      {{- end }}
      {{- with $v.probes.liveness }}
      # Triton keeps answering live and ready after its Python stub dies (every request then fails)
      # or wedges, or the model's engine dies, so liveness also asks for a live stub process, no
      # engine-dead report and a fresh heartbeat from the model (it beats only while its engine serves).
      livenessProbe:
        exec:
          command:
            - /bin/bash
            - -c
            - |
              alive=0
              for f in /proc/[0-9]*/cmdline; do
                case "$(tr '\0' ' ' < "$f" 2>/dev/null)" in *triton_python_backend_stu[b]*) alive=1; break ;; esac
              done
              if [ "$alive" != 1 ]; then echo "no live triton_python_backend_stub: the model's Python stub died" >&2; exit 1; fi
              dead={{ include "dflash-trt.controlDir" $root }}/engine-dead
              if [ -e "$dead" ]; then echo "the model's engine is dead: $(head -c 300 "$dead")" >&2; exit 1; fi
              hb={{ include "dflash-trt.controlDir" $root }}/heartbeat
              if [ -e "$hb" ] && [ $(( $(date +%s) - $(stat -c %Y "$hb") )) -gt 10 ]; then
                echo "the model's heartbeat is stale: its Python stub or its engine is wedged" >&2; exit 1
              fi
              exec 3<>/dev/tcp/127.0.0.1/8000 || exit 1
              printf 'GET /v2/health/live HTTP/1.0\r\n\r\n' >&3
              head -n 1 <&3 | grep -q ' 200 ' || { echo "/v2/health/live is not 200" >&2; exit 1; }
        periodSeconds: {{ int .periodSeconds }}
        timeoutSeconds: {{ int .timeoutSeconds }}
        failureThreshold: {{ int .failureThreshold }}
      {{- end }}
      # Drain before SIGTERM: new requests get 503, in-flight ones have server.drainSeconds, then
      # whatever is left ends with an explicit error (see dflash-trt.terminationGracePeriodSeconds).
      lifecycle:
        preStop:
          exec:
            command:
              - /bin/sh
              - -c
              - |
                sleep {{ int $v.server.preStopSleepSeconds }}
                d={{ include "dflash-trt.controlDir" $root }}
                printf '%s\n' {{ int $v.server.drainSeconds }} > "$d/.drain.tmp" && mv "$d/.drain.tmp" "$d/drain"
                end=$(( $(date +%s) + {{ add (int $v.server.drainSeconds) 15 }} ))
                while [ ! -e "$d/drained" ] && [ ! -e "$d/finalized" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 1; done
      {{- end }}
      {{- with include "dflash-trt.gpuResources" $root | fromYaml }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: bundle
          mountPath: {{ $v.bundle.mountPath }}
          {{- with $v.storage.subPath }}
          subPath: {{ . }}
          {{- end }}
          {{- if $v.storage.readOnly }}
          readOnly: true
          {{- end }}
        - name: dshm
          mountPath: /dev/shm
        {{- if ne $role "worker" }}
        - name: control
          mountPath: {{ include "dflash-trt.controlDir" $root }}
        {{- end }}
        {{- if $v.multiNode.enabled }}
        - name: ssh
          mountPath: /etc/dflash-trt/ssh
          readOnly: true
        {{- end }}
        {{- with $v.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- /* OpenAI-compatible front sidecar (issue 15): templates/_openai.tpl */}}
    {{- if and $v.openai.enabled (ne $role "worker") }}
    {{- include "dflash-trt.openaiContainer" $root | nindent 4 }}
    {{- end }}
  volumes:
    - name: bundle
      {{- if eq $v.storage.type "emptyDir" }}
      {{- if $v.storage.emptyDirSizeLimit }}
      emptyDir:
        sizeLimit: {{ $v.storage.emptyDirSizeLimit }}
      {{- else }}
      emptyDir: {}
      {{- end }}
      {{- else }}
      persistentVolumeClaim:
        claimName: {{ include "dflash-trt.claimName" $root }}
        {{- if $v.storage.readOnly }}
        readOnly: true
        {{- end }}
      {{- end }}
    # Triton's Python backend and NCCL exchange tensors through /dev/shm; the container
    # runtime's 64 MiB default fails the first large request.
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shm.sizeLimit }}
    # The model's control files: the drain handshake with the preStop hook (drain / drained /
    # finalized) and its liveness for the probes (heartbeat, engine-dead).
    - name: control
      emptyDir:
        sizeLimit: 1Mi
    {{- if $v.multiNode.enabled }}
    - name: ssh
      secret:
        secretName: {{ $v.multiNode.sshSecretName }}
        defaultMode: 0400
    {{- end }}
    {{- with $v.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
