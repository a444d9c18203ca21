{{/*
On-cluster build (buildJob): a Job runs `dflash-trt build` once into the bundle volume; the serving
pods wait in an init container until the bundle is complete. The bundle writer renames a finished
directory into place, so a manifest.json at the output path is a complete bundle; the markers next
to it tie that bundle to this build spec (an upgrade with other args waits for the new build).
*/}}

{{/* Fingerprint of what the Job builds: args, output and image. It names the Job (Jobs are immutable). */}}
{{- define "dflash-trt.buildFingerprint" -}}
{{- $b := .Values.buildJob -}}
{{- $spec := dict "args" $b.args "out" $b.outputSubPath "image" (include "dflash-trt.buildImage" .) -}}
{{- if $b.precompile }}{{- $_ := set $spec "precompile" true -}}{{- end -}}
{{- $spec | toJson | sha256sum | trunc 10 -}}
{{- end -}}

{{- define "dflash-trt.buildJobName" -}}
{{- printf "%s-build-%s" (include "dflash-trt.fullname" . | trunc 46 | trimSuffix "-") (include "dflash-trt.buildFingerprint" .) -}}
{{- end -}}

{{- define "dflash-trt.buildImage" -}}
{{- $b := .Values.buildJob -}}
{{- if $b.image.repository -}}
{{- include "dflash-trt.image" (dict "repository" $b.image.repository "tag" ($b.image.tag | default .Values.image.tag) "digest" "") -}}
{{- else -}}
{{- include "dflash-trt.dflashImage" . -}}
{{- end -}}
{{- end -}}

{{/* Where the bundle lives in the containers: bundle.mountPath, or the Job's output under it. */}}
{{- define "dflash-trt.bundlePath" -}}
{{- $root := trimSuffix "/" .Values.bundle.mountPath -}}
{{- if .Values.buildJob.enabled -}}
{{- printf "%s/%s" $root .Values.buildJob.outputSubPath -}}
{{- else -}}
{{- $root -}}
{{- end -}}
{{- end -}}

{{- define "dflash-trt.buildMarker" -}}
{{- printf "%s/.dflash-trt-build-%s" (trimSuffix "/" .root.Values.bundle.mountPath) (include "dflash-trt.buildFingerprint" .root) -}}.{{ .state }}
{{- end -}}

{{/* The serving pods' init container: wait for the Job's complete bundle, fail when the Job failed. */}}
{{- define "dflash-trt.waitForBundle" -}}
{{- $v := .Values -}}
{{- $job := include "dflash-trt.buildJobName" . -}}
{{- $period := int $v.buildJob.waitPeriodSeconds -}}
- name: wait-for-bundle
  image: {{ include "dflash-trt.image" $v.image }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command:
    - /bin/sh
    - -c
    - |
      set -eu
      manifest={{ squote (printf "%s/manifest.json" (include "dflash-trt.bundlePath" .)) }}
      done_marker={{ squote (include "dflash-trt.buildMarker" (dict "root" . "state" "done")) }}
      failed_marker={{ squote (include "dflash-trt.buildMarker" (dict "root" . "state" "failed")) }}
      echo "wait-for-bundle: waiting for Job {{ $job }} to write $manifest"
      waited=0
      while :; do
        if [ -f "$failed_marker" ]; then
          echo "wait-for-bundle: the build Job {{ $job }} failed: $(cat "$failed_marker"); fix: see kubectl logs job/{{ $job }}, correct buildJob.args and helm upgrade" >&2
          exit 1
        fi
        if [ -f "$done_marker" ] && grep -q '"schema_version"' "$manifest" 2>/dev/null; then
          echo "wait-for-bundle: $manifest is complete"
          exit 0
        fi
        sleep {{ $period }}
        waited=$((waited + {{ $period }}))
        if [ $((waited % 60)) -lt {{ $period }} ]; then
          echo "wait-for-bundle: still waiting after ${waited}s (kubectl get job {{ $job }})"
        fi
      done
  resources:
    requests:
      cpu: 10m
      memory: 16Mi
    limits:
      memory: 64Mi
  {{- with $v.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: bundle
      mountPath: {{ $v.bundle.mountPath }}
      readOnly: true
      {{- with $v.storage.subPath }}
      subPath: {{ . }}
      {{- end }}
{{- end -}}
