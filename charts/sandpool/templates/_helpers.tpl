{{/* Names: every resource name comes from these helpers. */}}

{{- define "sandpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sandpool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "sandpool.api.fullname" -}}{{ include "sandpool.fullname" . }}-api{{- end -}}
{{- define "sandpool.controller.fullname" -}}{{ include "sandpool.fullname" . }}-controller{{- end -}}
{{- define "sandpool.redis.fullname" -}}{{ include "sandpool.fullname" . }}-redis{{- end -}}
{{- define "sandpool.pools.fullname" -}}{{ include "sandpool.fullname" . }}-pools{{- end -}}
{{- define "sandpool.auth.fullname" -}}{{ include "sandpool.fullname" . }}-auth{{- end -}}
{{- define "sandpool.signing.fullname" -}}{{ include "sandpool.fullname" . }}-signing{{- end -}}
{{- define "sandpool.redisurl.fullname" -}}{{ include "sandpool.fullname" . }}-redis-url{{- end -}}
{{- define "sandpool.egress.fullname" -}}{{ include "sandpool.fullname" . }}-egress{{- end -}}

{{- define "sandpool.serviceAccountName" -}}
{{- default (include "sandpool.controller.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The namespace the sandbox pods run in. */}}
{{- define "sandpool.sandboxNamespace" -}}
{{- default .Release.Namespace .Values.sandboxes.namespace -}}
{{- end -}}

{{/* Labels. Sandbox pods carry the provider's labels instead (see sandbox/networkpolicy.yaml). */}}
{{- define "sandpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "sandpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* selectorLabels: (dict "ctx" $ "component" "api") */}}
{{- define "sandpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sandpool.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The installation name (--kube-installation): the provider's label on every sandbox pod. */}}
{{- define "sandpool.installation" -}}
{{- default .Release.Name .Values.sandboxes.installation -}}
{{- end -}}

{{/* The labels the kubernetes provider puts on every sandbox pod of this installation
     (services/sandpool/providers/kubernetes/pods.py, sandbox_labels). */}}
{{- define "sandpool.sandboxSelectorLabels" -}}
app.kubernetes.io/name: sandpool
app.kubernetes.io/component: sandbox
sandpool.dev/installation: {{ include "sandpool.installation" . }}
{{- end -}}

{{/* Images. */}}
{{- define "sandpool.imageRef" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .default .image.tag | toString) -}}
{{- end -}}
{{- end -}}

{{- define "sandpool.image" -}}
{{- include "sandpool.imageRef" (dict "image" .Values.image "default" .Chart.AppVersion) -}}
{{- end -}}

{{- define "sandpool.sandboxImage" -}}
{{- include "sandpool.imageRef" (dict "image" .Values.sandboxImage "default" .Chart.AppVersion) -}}
{{- end -}}

{{- define "sandpool.redis.image" -}}
{{- include "sandpool.imageRef" (dict "image" .Values.redis.bundled.image "default" "latest") -}}
{{- end -}}

{{/* Security contexts: fixed and hardened, only the ids are values. */}}
{{- define "sandpool.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "sandpool.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Soft spreading of a component's replicas over nodes. */}}
{{- define "sandpool.antiAffinity" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "sandpool.selectorLabels" . | nindent 12 }}
{{- end -}}

{{- define "sandpool.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
A secret value kept across upgrades: the given value, else the live Secret's
value when the Secret exists (helm upgrade), else a fresh random one.
(dict "ctx" $ "secret" NAME "key" KEY "given" VALUE "length" N) -> base64 text
*/}}
{{- define "sandpool.keptSecret" -}}
{{- $live := lookup "v1" "Secret" .ctx.Release.Namespace .secret -}}
{{- if .given -}}
{{- .given | b64enc -}}
{{- else if and $live $live.data (hasKey $live.data .key) -}}
{{- index $live.data .key -}}
{{- else -}}
{{- include "sandpool.generated" (dict "ctx" .ctx "id" (printf "%s/%s" .secret .key) "length" .length) -}}
{{- end -}}
{{- end -}}

{{/*
A random value generated once per render. secrets.yaml is rendered again by
the checksum annotations; without this memo each rendering would draw new
values, and the install's checksums would not match the first upgrade's.
(dict "ctx" $ "id" ID "length" N), or "length" 0 for an Ed25519 key -> base64 text
*/}}
{{- define "sandpool.generated" -}}
{{- if not (hasKey .ctx.Values "sandpoolGeneratedMemo") -}}
{{- $_ := set .ctx.Values "sandpoolGeneratedMemo" dict -}}
{{- end -}}
{{- $memo := .ctx.Values.sandpoolGeneratedMemo -}}
{{- if not (hasKey $memo .id) -}}
{{- if eq (int .length) 0 -}}
{{- $_ := set $memo .id (genPrivateKey "ed25519" | b64enc) -}}
{{- else -}}
{{- $_ := set $memo .id (randAlphaNum (int .length) | b64enc) -}}
{{- end -}}
{{- end -}}
{{- index $memo .id -}}
{{- end -}}

{{/* Whether the release holds a signing (private) key: given, or generated. */}}
{{- define "sandpool.hasSigningKey" -}}
{{- if or .Values.auth.privateKey (and .Values.auth.generateSigningKey (not .Values.auth.publicKeys) (not .Values.auth.existingSecret)) -}}
true
{{- end -}}
{{- end -}}

{{/* The Secret with the Redis URL (SANDPOOL_REDIS_URL) and its key. */}}
{{- define "sandpool.redisUrlSecret" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecret -}}
{{- else -}}
{{- include "sandpool.redisurl.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "sandpool.redisUrlKey" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecretKey -}}
{{- else -}}
url
{{- end -}}
{{- end -}}

{{- define "sandpool.authSecret" -}}
{{- default (include "sandpool.auth.fullname" .) .Values.auth.existingSecret -}}
{{- end -}}

{{/* Key ids of the public keys in the auth Secret. */}}
{{- define "sandpool.publicKeyIds" -}}
{{- if .Values.auth.existingSecret -}}
{{- join "," .Values.auth.existingSecretKeyNames -}}
{{- else -}}
{{- join "," (keys .Values.auth.publicKeys | sortAlpha) -}}
{{- end -}}
{{- end -}}

{{/* Checks that fail the render with a message naming the value. */}}
{{- define "sandpool.validate" -}}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) -}}
{{- fail "redis.mode=external needs redis.external.url or redis.external.existingSecret" -}}
{{- end -}}
{{- if and .Values.auth.existingSecret (not .Values.auth.existingSecretKeyNames) -}}
{{- fail "auth.existingSecret needs auth.existingSecretKeyNames (the <name>.pub entries to trust)" -}}
{{- end -}}
{{- if and (not .Values.auth.publicKeys) (not .Values.auth.existingSecret) (not (include "sandpool.hasSigningKey" .)) -}}
{{- fail "no token key: set auth.publicKeys, auth.existingSecret or auth.privateKey, or leave auth.generateSigningKey on" -}}
{{- end -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,18}[a-z0-9])?$" (include "sandpool.installation" .)) -}}
{{- fail (printf "the installation name %q (the release name unless sandboxes.installation is set) must be 1-20 lowercase letters, digits or '-': set sandboxes.installation" (include "sandpool.installation" .)) -}}
{{- end -}}
{{- if not .Values.pools -}}
{{- fail "pools: at least one pool is needed" -}}
{{- end -}}
{{- $seen := dict -}}
{{- range .Values.pools -}}
{{- if hasKey $seen .name -}}
{{- fail (printf "pools: the name %q is used twice" .name) -}}
{{- end -}}
{{- $_ := set $seen .name true -}}
{{- if gt (int .warm) (int .ceiling) -}}
{{- fail (printf "pools[%s]: warm (%d) is above ceiling (%d)" .name (int .warm) (int .ceiling)) -}}
{{- end -}}
{{- end -}}
{{- range .Values.pools -}}
{{- if .egress -}}
{{- fail (printf "pools[%s].egress is removed: sandboxes reach the network only through the egress proxy (egress.enabled), to what each workspace's policy (egress_allow) allows; see docs/helm.md, \"Migrating egress\"" .name) -}}
{{- end -}}
{{- end -}}
{{- if .Values.sandboxes.egress -}}
{{- fail "sandboxes.egress is removed: set egress.enabled and egress.allowCeiling, and each workspace's egress_allow; see docs/helm.md, \"Migrating egress\"" -}}
{{- end -}}
{{- if eq .Values.controller.provider "local" -}}
{{- fail "controller.provider=local is not offered by the chart: local sandboxes are processes in the controller's pod, reached over Unix sockets there, which the api's pods cannot reach. Use controller.provider=kubernetes, or `sandpool up` to try sandpool on one machine (docs/helm.md, \"The local provider\")" -}}
{{- end -}}
{{- if .Values.internalCredential -}}
{{- fail "internalCredential is removed: the api holds the edge and the session layer in one process, with no internal credential; drop the value (docs/helm.md, \"Upgrades\")" -}}
{{- end -}}
{{- if .Values.proxy -}}
{{- fail "proxy.* is renamed api.* (the api Deployment serves the contract): move the values (docs/helm.md, \"Upgrades\")" -}}
{{- end -}}
{{- if .Values.scheduler -}}
{{- fail "scheduler.* is renamed controller.* (the controller Deployment keeps the pools warm): move the values (docs/helm.md, \"Upgrades\")" -}}
{{- end -}}
{{- if and .Values.sandboxes.createNamespace (not .Values.sandboxes.namespace) -}}
{{- fail "sandboxes.createNamespace needs sandboxes.namespace (the release namespace already exists)" -}}
{{- end -}}
{{- end -}}

{{/* A NetworkPolicy peer (one list item) from the chart's closed form {cidr | namespaceLabels/podLabels}. */}}
{{- define "sandpool.peer" -}}
{{- $peer := dict -}}
{{- if .cidr -}}
{{- $_ := set $peer "ipBlock" (dict "cidr" .cidr) -}}
{{- else -}}
{{- with .namespaceLabels }}{{ $_ := set $peer "namespaceSelector" (dict "matchLabels" .) }}{{ end -}}
{{- with .podLabels }}{{ $_ := set $peer "podSelector" (dict "matchLabels" .) }}{{ end -}}
{{- end -}}
{{- list $peer | toYaml -}}
{{- end -}}

{{/* pools.yaml in the format of services/sandpool/controller/templates.py (snake_case keys). */}}
{{- define "sandpool.poolsFile" -}}
pools:
{{- range .Values.pools }}
  - name: {{ .name | quote }}
    image: {{ default (include "sandpool.sandboxImage" $) .image | quote }}
    warm: {{ int .warm }}
    {{- if hasKey . "maxWarm" }}
    max_warm: {{ int .maxWarm }}
    {{- end }}
    ceiling: {{ int .ceiling }}
    {{- with .resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .runtimeClassName }}
    runtime_class: {{ . | quote }}
    {{- end }}
    {{- with .nodeSelector }}
    node_selector:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .tolerations }}
    tolerations:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .workspaceSize }}
    workspace_size: {{ . | quote }}
    {{- end }}
    {{- with .args }}
    args:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end }}
{{- end -}}
{{/* The api's command line (flags of `sandpool api`, services/sandpool/api/settings.py): the edge
     and the session layer in one process, multi-tenant with the trusted keys. */}}
{{- define "sandpool.api.args" -}}
- api
- --host=0.0.0.0
- --port={{ .Values.api.port }}
- --pools-file=/etc/sandpool/pools.yaml
- --auth-audience={{ .Values.auth.audience }}
{{- range $kid := splitList "," (include "sandpool.publicKeyIds" .) }}
{{- if $kid }}
- --auth-public-key=/etc/sandpool/keys/{{ $kid }}.pub
{{- end }}
{{- end }}
{{- if include "sandpool.hasSigningKey" . }}
- --auth-public-key=/etc/sandpool/derived/signing.pub
{{- end }}
{{- range .Values.api.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The controller's command line (flags of `sandpool controller`, services/sandpool/controller/settings.py,
     and of the kubernetes provider). */}}
{{- define "sandpool.controller.args" -}}
- controller
- --host=0.0.0.0
- --port={{ .Values.controller.port }}
- --pools-file=/etc/sandpool/pools.yaml
- --provider={{ .Values.controller.provider }}
- --kube-namespace={{ include "sandpool.sandboxNamespace" . }}
- --kube-installation={{ include "sandpool.installation" . }}
- --kube-agent-port={{ .Values.sandboxes.agentPort }}
- --kube-sandbox-uid={{ .Values.sandboxes.uid }}
- --kube-image-pull-policy={{ .Values.image.pullPolicy }}
{{- with .Values.sandboxes.priorityClassName }}
- --kube-priority-class={{ . }}
{{- end }}
{{- if .Values.egress.enabled }}
- --kube-egress-proxy={{ include "sandpool.egress.fullname" . }}.{{ .Release.Namespace }}.svc:{{ .Values.egress.port }}
{{- end }}
{{- range .Values.controller.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The egress proxy's command line (flags of `sandpool egress`, services/sandpool/egress/settings.py). */}}
{{- define "sandpool.egress.args" -}}
- egress
- --host=0.0.0.0
- --port={{ .Values.egress.port }}
- --metrics-host=0.0.0.0
- --metrics-port={{ .Values.egress.metricsPort }}
{{- with .Values.egress.allowCeiling }}
- {{ printf "--egress-allow-ceiling=%s" (join "," .) | quote }}
{{- end }}
{{- with .Values.egress.denyCidrs }}
- {{ printf "--deny-cidrs=%s" (join "," .) | quote }}
{{- end }}
{{- range .Values.egress.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* redis.conf of the bundled Redis. */}}
{{- define "sandpool.redis.conf" -}}
# Durable state: append-only file plus periodic snapshots.
dir /data
appendonly yes
appendfsync {{ .Values.redis.bundled.appendfsync }}
save 900 1 300 10 60 10000
# sandpool's keys must never be evicted: refuse writes instead.
maxmemory-policy noeviction
{{- with .Values.redis.bundled.maxmemory }}
maxmemory {{ . }}
{{- end }}
protected-mode no
port 6379
# The password, from the Secret (never on a command line).
include /etc/redis-auth/auth.conf
{{- end -}}

{{/*
A bundled Redis with persistence and no storageClass needs the cluster's default StorageClass:
without one its claim stays Pending forever, Redis never starts and nothing becomes Ready, while
`helm install` reports success. Refuse instead, saying what to set. Only against a live cluster
(`helm template` and client-side dry runs look nothing up: kube-system is then not found).
*/}}
{{- define "sandpool.redis.checkStorageClass" -}}
{{- $p := .Values.redis.bundled.persistence -}}
{{- if and $p.enabled $p.checkStorageClass (not $p.storageClass) (lookup "v1" "Namespace" "" "kube-system") -}}
{{- $default := false -}}
{{- range (lookup "storage.k8s.io/v1" "StorageClass" "" "").items -}}
{{- $a := default (dict) .metadata.annotations -}}
{{- if or (eq (toString (index $a "storageclass.kubernetes.io/is-default-class")) "true") (eq (toString (index $a "storageclass.beta.kubernetes.io/is-default-class")) "true") -}}
{{- $default = true -}}
{{- end -}}
{{- end -}}
{{- if not $default -}}
{{- fail "redis.bundled.persistence: this cluster has no default StorageClass, so Redis's PersistentVolumeClaim would stay Pending forever and no sandpool pod would become Ready. Set redis.bundled.persistence.storageClass to one that exists, or redis.bundled.persistence.enabled=false (an emptyDir: Redis's data is lost when its pod restarts), or redis.mode=external (docs/helm.md, \"Redis storage\"). redis.bundled.persistence.checkStorageClass=false skips this check." -}}
{{- end -}}
{{- end -}}
{{- end -}}
