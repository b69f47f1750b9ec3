{{/* Names, labels and the settings both containers share. */}}

{{- define "r3.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "r3.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
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
