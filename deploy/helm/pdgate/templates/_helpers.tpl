{{/* Names: <release>-pdgate, or the release name when it already says pdgate. */}}
{{- define "pdgate.fullname" -}}
{{- if contains "pdgate" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-pdgate" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdgate.gateway" -}}{{ include "pdgate.fullname" . }}-gateway{{- end -}}

{{/* Labels every object of the release carries. */}}
{{- define "pdgate.labels" -}}
app.kubernetes.io/part-of: pdgate
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The gateway's pods, exactly (Deployment, Service, PDB and ServiceMonitor select by these). */}}
{{- define "pdgate.gatewaySelector" -}}
app.kubernetes.io/name: pdgate-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of the gateway's objects: component=gateway keeps its pods out of every worker selector. */}}
{{- define "pdgate.gatewayLabels" -}}
{{ include "pdgate.labels" . }}
app.kubernetes.io/name: pdgate-gateway
app.kubernetes.io/component: gateway
{{- end -}}

{{/* `k=v` words of a label map, sorted by key. */}}
{{- define "pdgate.labelArgs" -}}
{{- range $k, $v := . }}
- {{ printf "%s=%s" $k $v | quote }}
{{- end }}
{{- end -}}

{{/* --selector: the configured labels, plus this release's instance label when asked. */}}
{{- define "pdgate.discoverySelector" -}}
{{- $sel := deepCopy (.Values.discovery.selector | default dict) -}}
{{- if not .Values.gateway.pdDisaggregation -}}
{{- $sel = merge $sel (.Values.discovery.regularSelector | default dict) -}}
{{- end -}}
{{- if .Values.discovery.sameReleaseOnly -}}
{{- $_ := set $sel "app.kubernetes.io/instance" .Release.Name -}}
{{- end -}}
{{- include "pdgate.labelArgs" $sel -}}
{{- end -}}

{{/* The `pdgate launch` options (after `launch`), one list item per word. */}}
{{- define "pdgate.gatewayArgs" -}}
{{- $g := .Values.gateway -}}
- --host
- 0.0.0.0
- --port
- {{ $g.port | quote }}
- --shutdown-grace-period-secs
- {{ $g.drainSeconds | quote }}
{{- if and $g.epdDisaggregation (not $g.pdDisaggregation) }}
{{- fail "gateway.epdDisaggregation needs gateway.pdDisaggregation: EPD is PD mode plus encode workers" }}
{{- end }}
{{- if $g.epdDisaggregation }}
- --epd-disaggregation
- --kv-connector
- {{ $g.kvConnector | quote }}
{{- else if $g.pdDisaggregation }}
- --pd-disaggregation
- --kv-connector
- {{ $g.kvConnector | quote }}
{{- end }}
- --policy
- {{ $g.policy | quote }}
- --cache-source
- {{ $g.cacheSource | default "auto" | quote }}
{{- if and $g.pdDisaggregation $g.prefillPolicy }}
- --prefill-policy
- {{ $g.prefillPolicy | quote }}
{{- end }}
{{- if and $g.pdDisaggregation $g.decodePolicy }}
- --decode-policy
- {{ $g.decodePolicy | quote }}
{{- end }}
- --request-timeout-secs
- {{ $g.requestTimeoutSecs | quote }}
- --health-check-interval-secs
- {{ $g.healthCheckIntervalSecs | quote }}
- --log-level
- {{ $g.logLevel | quote }}
{{- if .Values.discovery.enabled }}
- --service-discovery
- --service-discovery-namespace
- {{ .Release.Namespace | quote }}
- --service-discovery-port
- {{ .Values.discovery.port | quote }}
- --selector
{{- include "pdgate.discoverySelector" . }}
{{- if $g.pdDisaggregation }}
- --prefill-selector
{{- include "pdgate.labelArgs" .Values.discovery.prefillSelector }}
- --decode-selector
{{- include "pdgate.labelArgs" .Values.discovery.decodeSelector }}
{{- end }}
{{- if and $g.epdDisaggregation .Values.discovery.encodeSelector }}
- --encode-selector
{{- include "pdgate.labelArgs" .Values.discovery.encodeSelector }}
{{- end }}
{{- end }}
{{- if .Values.workerTls.caConfigMap }}
- --worker-ca-cert
- {{ printf "/etc/pdgate/worker-ca/%s" .Values.workerTls.caKey | quote }}
{{- end }}
{{- range $g.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
