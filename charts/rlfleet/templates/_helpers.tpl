{{/* Names and labels: every name the chart uses is built here, once. */}}

{{- define "rlfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rlfleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rlfleet.operatorName" -}}
{{- printf "%s-operator" (include "rlfleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rlfleet.redisName" -}}
{{- printf "%s-redis" (include "rlfleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rlfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rlfleet.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rlfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "rlfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rlfleet
{{- end -}}

{{/* Selector labels of one chart component: (dict "ctx" $ "component" "operator") */}}
{{- define "rlfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlfleet.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rlfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "rlfleet.operatorImage" -}}
{{- printf "%s:%s" .Values.operatorImage.repository (default .Chart.AppVersion .Values.operatorImage.tag) -}}
{{- end -}}

{{- define "rlfleet.gpuImage" -}}
{{- printf "%s:%s" .Values.gpuImage.repository (default .Chart.AppVersion .Values.gpuImage.tag) -}}
{{- end -}}

{{/* URL of the in-chart Redis (only meaningful with redis.enabled). */}}
{{- define "rlfleet.redisUrl" -}}
{{- printf "redis://%s.%s.svc:%v/0" (include "rlfleet.redisName" .) .Release.Namespace .Values.redis.service.port -}}
{{- end -}}

{{/* The Secret holding the in-chart Redis's password: redis.auth.existingSecret, else the one the chart
     generates (redis.yaml); empty without redis.enabled or with redis.auth.enabled false and no existingSecret. */}}
{{- define "rlfleet.redisPasswordSecret" -}}
{{- if and .Values.redis.enabled (or .Values.redis.auth.enabled .Values.redis.auth.existingSecret) -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-auth" (include "rlfleet.redisName" .)) -}}
{{- end -}}
{{- end -}}

{{- define "rlfleet.redisPasswordKey" -}}
{{- ternary .Values.redis.auth.passwordKey "password" (ne .Values.redis.auth.existingSecret "") -}}
{{- end -}}

{{- define "rlfleet.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "rlfleet.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The rules for the rlfleet.io kinds and the children the operator builds from them: exactly what
     it calls (tests/operator/test_rbac_replay.py replays every request of the operator tests against them). */}}
{{- define "rlfleet.namespacedRules" -}}
- apiGroups: ["rlfleet.io"]
  resources: ["rlruns", "inferencepools", "relaytiers"]
  verbs: ["get", "list", "watch", "patch", "update"]
# A finished run past spec.ttlSecondsAfterFinished is deleted (its children, pools and tiers follow).
- apiGroups: ["rlfleet.io"]
  resources: ["rlruns"]
  verbs: ["delete"]
- apiGroups: ["rlfleet.io"]
  resources: ["rlruns/status", "inferencepools/status", "relaytiers/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["rlfleet.io"]
  resources: ["inferencepools/scale", "relaytiers/scale"]
  verbs: ["get", "patch", "update"]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: ["rlfleet.io"]
  resources: ["rlruns/finalizers", "inferencepools/finalizers", "relaytiers/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Read, never list: the Secrets a run names (Redis URL, signing key, store credentials, worker tokens),
# to report a missing one or key before a pod fails on it, and to read the Redis URL for status.
# Create, never update or delete: a run that names no signing key (or no Redis, with defaults.redis) gets
# its own Secret, owned by the run, which the garbage collector deletes with it (rundefaults.py).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# A deleted run's Redis keys go only once its pods are gone (found by the run label).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
