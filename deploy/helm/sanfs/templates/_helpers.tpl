{{/* The image every sanfs container runs. */}}
{{- define "sanfs.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{/* host:port of the metadata server: the value given, else the chart's own server. */}}
{{- define "sanfs.server" -}}
{{- if .Values.server -}}
{{ .Values.server }}
{{- else if .Values.metadataServer.enabled -}}
{{ .Release.Name }}-mds.{{ .Release.Namespace }}.svc:{{ .Values.metadataServer.port }}
{{- else -}}
{{ fail "set server (host:port of sanfs-mds) or metadataServer.enabled" }}
{{- end }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "sanfs.labels" -}}
app.kubernetes.io/name: sanfs
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}
