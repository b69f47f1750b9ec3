{{/* Names, labels and the settings both containers share. */}}

{{- define "r3.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Helm's usual rules (`fullnameOverride`; a release name that already contains the chart's name is used
alone), plus one: a chart name that already starts with `<release>-` is used alone, so release `r3` of
chart `r3-sidecar` is `r3-sidecar`, not `r3-r3-sidecar`. Truncated to 52 characters, not 63: the
StatefulSet's pods carry the label `controller-revision-hash: <name>-<hash>`, which must fit in 63.
*/}}
{{- define "r3.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else if hasPrefix (printf "%s-" .Release.Name) $name }}
{{- $name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The headless Service: one DNS name per pod, `<pod>.<this>.<namespace>.svc.<clusterDomain>`. */}}
{{- define "r3.headlessName" -}}
{{- printf "%s-pods" (include "r3.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "r3.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "r3.selectorLabels" -}}
app.kubernetes.io/name: {{ include "r3.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The SGLang pods only (not the helm test pod, which shares the release labels). */}}
{{- define "r3.podSelectorLabels" -}}
{{ include "r3.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{- define "r3.labels" -}}
helm.sh/chart: {{ include "r3.chart" . }}
{{ include "r3.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: r3-sidecar
{{- end }}

{{- define "r3.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "r3.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "r3.authSecretName" -}}
{{- default (printf "%s-auth" (include "r3.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* R3_SPOOL_MAX_BYTES: the emptyDir size less the reserve, so writers stop before the kubelet evicts. */}}
{{- define "r3.spoolMaxBytes" -}}
{{- div (mul (int64 .Values.spool.sizeMiB) 1048576 (sub 100 (int64 .Values.spool.reservePercent))) 100 }}
{{- end }}

{{/* The address trainers are told to fetch from: this pod's own sidecar. */}}
{{- define "r3.sidecarURL" -}}
{{- if eq .Values.sidecar.advertise "podIP" }}
{{- printf "http://$(POD_IP):%d" (int .Values.sidecar.port) }}
{{- else }}
{{- printf "http://$(POD_NAME).%s.%s.svc.%s:%d" (include "r3.headlessName" .) .Release.Namespace .Values.clusterDomain (int .Values.sidecar.port) }}
{{- end }}
{{- end }}

{{/* Downward-API variables; R3_SIDECAR_URL and R3_ENGINE_ID expand them, so they come first. */}}
{{- define "r3.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: R3_SIDECAR_URL
  value: {{ include "r3.sidecarURL" . | quote }}
{{- end }}

{{- define "r3.image" -}}
{{- printf "%s:%s" .repository .tag }}
{{- end }}

{{/*
Where the sidecar's token comes from; secret.yaml and NOTES.txt both ask, so they cannot disagree:
  existingSecret  auth.existingSecret (nothing rendered)
  value           auth.token
  kept            the token in the Secret this release created earlier (read back with lookup)
  generated       first install against a cluster: a new random token
`lookup` sees the cluster when the namespace's `kube-root-ca.crt` ConfigMap (published into every namespace
by the kube-controller-manager since Kubernetes 1.20) is visible. Offline (`helm template`, Argo CD,
`--dry-run`) it sees nothing; a token drawn there would differ on every render, so the render fails.
*/}}
{{- define "r3.authTokenSource" -}}
{{- if .Values.auth.existingSecret }}existingSecret
{{- else if .Values.auth.token }}value
{{- else }}
{{- $name := include "r3.authSecretName" . }}
{{- $existing := (lookup "v1" "Secret" .Release.Namespace $name) }}
{{- if and $existing (hasKey ($existing.data | default dict) .Values.auth.secretKey) }}kept
{{- else if (lookup "v1" "ConfigMap" .Release.Namespace "kube-root-ca.crt") }}generated
{{- else }}
{{- fail "auth: set auth.existingSecret (a Secret you manage) or auth.token, or auth.enabled=false. This render cannot see the cluster (helm template, Argo CD, --dry-run, or a namespace that does not exist yet), so the chart cannot read back the token it generated before, and a new random token on every render would lock trainers out after each sync." }}
{{- end }}
{{- end }}
{{- end }}

{{/* The monitoring objects' extra labels: monitoringLabels, then the object's own (which win). */}}
{{- define "r3.monitoringLabels" -}}
{{- $labels := merge (deepCopy (.own | default dict)) (deepCopy (.root.Values.monitoringLabels | default dict)) }}
{{- with $labels }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/* The model volume's claim name for `pvc` and `existingClaim`. */}}
{{- define "r3.modelClaimName" -}}
{{- if eq .Values.modelStorage.type "existingClaim" }}
{{- required "modelStorage.existingClaim is required with modelStorage.type=existingClaim" .Values.modelStorage.existingClaim }}
{{- else }}
{{- printf "%s-models" (include "r3.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* A PersistentVolumeClaim spec for `pvc` (the chart's claim) and `perPod` (volumeClaimTemplates). */}}
{{- define "r3.modelClaimSpec" -}}
accessModes:
  {{- toYaml .Values.modelStorage.accessModes | nindent 2 }}
{{- with .Values.modelStorage.storageClassName }}
storageClassName: {{ if eq . "-" }}""{{ else }}{{ . }}{{ end }}
{{- end }}
resources:
  requests:
    storage: {{ printf "%dGi" (int64 .Values.modelStorage.sizeGiB) }}
{{- end }}
