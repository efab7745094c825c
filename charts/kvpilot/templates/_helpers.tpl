{{/* Names and labels shared by every object of the release. */}}

{{- define "kvpilot.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpilot.labels" -}}
{{ include "kvpilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvpilot
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The default runtime image: config.runtimeImage, else the release's runtime at the chart's
appVersion, tagged -<config.runtimeVariant> for a variant (cpu: for clusters without GPUs). */}}
{{- define "kvpilot.runtimeImage" -}}
{{- $variant := .Values.config.runtimeVariant | default "" -}}
{{- if and $variant .Values.config.runtimeImage -}}
{{- fail "config.runtimeVariant picks a tag of the default runtime image: with config.runtimeImage set, name the variant's image there instead" -}}
{{- end -}}
{{- $tag := .Chart.AppVersion -}}
{{- if $variant -}}{{- $tag = printf "%s-%s" $tag $variant -}}{{- end -}}
{{- .Values.config.runtimeImage | default (printf "ghcr.io/kvpilot/runtime:%s" $tag) -}}
{{- end -}}

{{/* The operator's config.yaml, exactly the keys operator/kvpilot/operator/config.py accepts. */}}
{{- define "kvpilot.config" -}}
runtimeImage: {{ include "kvpilot.runtimeImage" . | quote }}
prometheusUrl: {{ .Values.config.prometheusUrl | quote }}
autoscalerIntervalSeconds: {{ .Values.config.autoscalerIntervalSeconds }}
spillAfterSeconds: {{ .Values.config.spillAfterSeconds }}
costWindowSeconds: {{ .Values.config.costWindowSeconds }}
nodeTypes: {{- if .Values.config.nodeTypes }}
{{ toYaml .Values.config.nodeTypes | indent 2 }}
{{- else }} []
{{- end }}
{{- end -}}

{{/*
Rights the operator needs in the namespaces it watches. Each rule names the code that needs it:
kopf = the framework (watches, progress annotations, peering), k8s.py = our API adapter
(server-side apply needs create as well as patch: it creates what does not exist yet).
*/}}
{{- define "kvpilot.namespacedRules" -}}
# GPU pods: kopf index gpu_pods (handlers.py), ready pods for direct scraping (runtime_metrics.py)
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# children: server-side apply, list for stale ones, delete (controller.py); kopf watches them
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
# model caches (spec.model.cache, model_cache.py): a claim and the Job that fills it, created
# once and patched only to add an owner; kopf watches the Jobs to start replicas once filled
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [create, patch]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
# quality evaluation (spec.quantization.evaluation, quality_io.py): the eval set's ConfigMap is
# read by name, the measurement cache (a ConfigMap per model) created and merged into; eval Jobs
# (above) are deleted once read. spec.model.configMapRef's ConfigMap (a file:// or pvc://
# checkpoint's config.json) is read by name too (model_facts.py)
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
{{- if .Values.rbac.readModelSecrets }}
# the Secret a ModelDeployment's spec.model.secretRef names, read by name (never listed) to
# fetch config.json of a model the catalog lacks, as its pods would (model_facts.py)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
# Events on ModelDeployments: the operator's (k8s.emit_event) through events.k8s.io/v1, kopf's
# error posting through core/v1
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# the custom resource: kopf watches it (no create/update handlers, so no bookkeeping patch); the
# operator never writes it, only its status
- apiGroups: [kvpilot.dev]
  resources: [modeldeployments]
  verbs: [get, list, watch]
- apiGroups: [kvpilot.dev]
  resources: [modeldeployments/status]
  verbs: [get, patch]
# Inference Extension InferencePools for ModelDeployments with spec.routing.endpointPickerRef,
# where that CRD is installed: server-side apply, read and delete when the spec drops the picker
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
{{- if .Values.podMonitors.enabled }}
# PodMonitors for ModelDeployments with spec.monitoring.podMonitor (podMonitors.enabled)
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, list, watch, create, patch, delete]
{{- end }}
{{- end -}}

{{/* Rights that only exist cluster-wide, needed in both modes. */}}
{{- define "kvpilot.clusterRules" -}}
# GPU node inventory: kopf index gpu_nodes (handlers.py)
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list, watch]
# kopf notices CRDs being added or removed (list, watch); the operator checks for the
# PodMonitor and InferencePool CRDs (get) and watches the latter arrive (inference-pool-crd)
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- end -}}

{{/* The gateway (kvpilot-gateway): its own name, labels, identity and image. */}}
{{- define "kvpilot.gateway.fullname" -}}
{{- printf "%s-gateway" (include "kvpilot.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpilot.gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "kvpilot.gateway.labels" -}}
{{ include "kvpilot.gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvpilot
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvpilot.gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create -}}
{{- default (include "kvpilot.gateway.fullname" .) .Values.gateway.serviceAccount.name -}}
{{- else -}}
{{- required "gateway.serviceAccount.name is required when gateway.serviceAccount.create is false" .Values.gateway.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator image (it carries the gateway extra) unless gateway.image names another. */}}
{{- define "kvpilot.gateway.image" -}}
{{- $repository := default .Values.image.repository .Values.gateway.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.gateway.image.tag -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{/*
What the gateway reads, in the namespaces it routes to (discovery.py, kube_wake.py):
*/}}
{{- define "kvpilot.gateway.rules" -}}
# ModelDeployments: listed and watched (served names, spec.routing); merge-patched only to set
# the kvpilot.dev/wake-requested-at annotation (kube_wake.py: wake from zero)
- apiGroups: [kvpilot.dev]
  resources: [modeldeployments]
  verbs: [list, watch, patch]
# the ready replicas: runtime pods (label kvpilot.dev/model), their IP, readiness, deletion
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
{{- if .Values.gateway.rbac.readProviderSecrets }}
# the API key of a spec.routing.fallbacks provider, read by name from the Secret it names
# (never listed or watched)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
{{- end -}}
