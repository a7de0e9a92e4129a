{{/* The images, tagged with the chart's appVersion unless a tag is given. */}}
{{- define "retex.operatorImage" -}}
{{ .Values.image.operator.repository }}:{{ .Values.image.operator.tag | default .Chart.AppVersion }}
{{- end }}
{{- define "retex.workerImage" -}}
{{ .Values.image.worker.repository }}:{{ .Values.image.worker.tag | default .Chart.AppVersion }}
{{- end }}
