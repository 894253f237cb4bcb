{{/* Names and labels. */}}
{{- define "graphfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "graphfleet.fullname" -}}
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

{{- define "graphfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "graphfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "graphfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "graphfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "graphfleet.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{/*
The startup budget in seconds (values.yaml, startup):
  ceil(safetyFactor x (rayStartSeconds + weightLoadSeconds + kernelJitSeconds + graphCaptureSeconds))
*/}}
{{- define "graphfleet.startupBudgetSeconds" -}}
{{- $s := .Values.startup }}
{{- $sum := addf $s.rayStartSeconds $s.weightLoadSeconds $s.kernelJitSeconds $s.graphCaptureSeconds }}
{{- mulf $s.safetyFactor $sum | ceil | int }}
{{- end }}

{{/* failureThreshold = ceil(budget / periodSeconds): failureThreshold x periodSeconds >= budget. */}}
{{- define "graphfleet.startupFailureThreshold" -}}
{{- $budget := include "graphfleet.startupBudgetSeconds" . | atoi }}
{{- divf $budget .Values.startup.periodSeconds | ceil | int }}
{{- end }}

{{/*
The drain budget in seconds (values.yaml, shutdown): ceil(config.serve.drain_timeout_s + drainMarginSeconds).
The head's preStop waits at most this long, and Serve's graceful_shutdown_timeout_s is the same.
*/}}
{{- define "graphfleet.drainBudgetSeconds" -}}
{{- addf .Values.config.serve.drain_timeout_s .Values.shutdown.drainMarginSeconds | ceil | int }}
{{- end }}

{{/* terminationGracePeriodSeconds of every pod: drain budget + workerHeadStartSeconds + rayStopSeconds. */}}
{{- define "graphfleet.terminationGraceSeconds" -}}
{{- $budget := include "graphfleet.drainBudgetSeconds" . | atoi }}
{{- addf $budget .Values.shutdown.workerHeadStartSeconds .Values.shutdown.rayStopSeconds | ceil | int }}
{{- end }}

{{/*
A worker's preStop: give the head's drain workerHeadStartSeconds to begin, then wait (at most the
drain budget) while the app's /health says "draining": this pod's ranks serve the drain's streams.
*/}}
{{- define "graphfleet.workerPreStop" -}}
{{- $port := .Values.config.serve.port -}}
sleep {{ .Values.shutdown.workerHeadStartSeconds }}; end=$((SECONDS + {{ include "graphfleet.drainBudgetSeconds" . }})); while [ $SECONDS -lt $end ] && wget --tries 1 -T 5 --content-on-error -q -O - http://${FQ_RAY_IP}:{{ $port }}/health | grep -q '"status": *"draining"'; do sleep 1; done
{{- end }}

{{/*
GPUs per pod of a role: one graphfleet worker group per pod, so ceil(tp x gpus_per_rank).
Arguments: (list $ role).
*/}}
{{- define "graphfleet.gpusPerPod" -}}
{{- $ := index . 0 }}
{{- $role := index . 1 }}
{{- $c := $.Values.config.cluster }}
{{- $tp := $c.tp_size }}
{{- if and (eq $role "prefill") $c.prefill_tp_size }}{{ $tp = $c.prefill_tp_size }}{{ end }}
{{- if and (eq $role "decode") $c.decode_tp_size }}{{ $tp = $c.decode_tp_size }}{{ end }}
{{- mulf $tp $c.gpus_per_rank | ceil | int }}
{{- end }}

{{/* Ray's own health on the dashboard agent (Ray >= 2.53), as an exec command fragment. */}}
{{- define "graphfleet.rayHealthCommand" -}}
wget --tries 1 -T {{ .Values.probes.readiness.timeoutSeconds }} -q -O /dev/null http://localhost:{{ .Values.probes.dashboardAgentPort }}/api/healthz
{{- end }}

{{/* The workers' liveness: Ray's own health only (values.yaml, probes). */}}
{{- define "graphfleet.livenessProbe" -}}
httpGet:
  path: /api/healthz
  port: {{ .Values.probes.dashboardAgentPort }}
periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
{{- end }}

{{/*
Serve's own recovery of a replica that stops answering, in seconds: REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD
(3) failed health checks, each up to healthCheckPeriodS + healthCheckTimeoutS, then its shutdown (at most
the drain budget). The head's liveness window must exceed it: Serve replaces the replica first.
*/}}
{{- define "graphfleet.serveRecoverySeconds" -}}
{{- $i := .Values.ingress }}
{{- $budget := include "graphfleet.drainBudgetSeconds" . | atoi }}
{{- addf (mulf 3 (addf $i.healthCheckPeriodS $i.healthCheckTimeoutS)) $budget | ceil | int }}
{{- end }}

{{/*
The head's liveness command (values.yaml, probes.replicaLiveness): Ray's own health, then GET /live on
the Serve port, which this pod's proxy forwards to the ingress replica wherever Serve placed it; the
x-request-timeout-seconds header makes the proxy answer 408 when the replica does not answer in time.
Fails when Ray is unhealthy, on a 408 or a 5xx other than 503, and when the proxy takes the connection
but answers nothing. Passes on any other answer and on a refused connection: nothing listens before
KubeRay deploys the app, its route is missing until then (404), and an app that failed to deploy gets
503; restarting the head fixes none of them.
*/}}
{{- define "graphfleet.headLivenessCommand" -}}
{{- $p := .Values.probes.replicaLiveness -}}
wget --tries 1 -T {{ $p.timeoutSeconds }} -q -O /dev/null http://localhost:{{ .Values.probes.dashboardAgentPort }}/api/healthz || { echo "Ray is not healthy: the dashboard agent's /api/healthz failed"; exit 1; }
out=$(LC_ALL=C wget -S --tries 1 -T {{ add $p.timeoutSeconds 1 }} -O /dev/null --header 'x-request-timeout-seconds: {{ $p.timeoutSeconds }}' http://127.0.0.1:{{ .Values.config.serve.port }}/live 2>&1)
code=$(printf '%s\n' "$out" | awk '$1 ~ /^HTTP\// {c = $2} END {print c}')
case "$code" in
  503) exit 0 ;;
  408|5??) ;;
  ?*) exit 0 ;;
  *) case "$out" in *"Connection refused"*) exit 0 ;; esac ;;
esac
echo "the replica did not answer GET /live: ${code:-no answer}"; printf '%s\n' "$out" | tail -n 2; exit 1
{{- end }}

{{- define "graphfleet.headLivenessProbe" -}}
{{- $p := .Values.probes.replicaLiveness }}
{{- $window := mul $p.failureThreshold $p.periodSeconds }}
{{- $serve := include "graphfleet.serveRecoverySeconds" . | atoi }}
{{- if le (int $window) $serve }}
{{- fail (printf "probes.replicaLiveness: failureThreshold x periodSeconds (%d s) must exceed Serve's own recovery of a replica that stops answering, 3 x (ingress.healthCheckPeriodS + ingress.healthCheckTimeoutS) + the drain budget = %d s, so that Serve replaces the replica before Kubernetes restarts the head (and with it the Ray cluster): raise probes.replicaLiveness.failureThreshold to %d or more" (int $window) $serve (add (div $serve (int $p.periodSeconds)) 1)) }}
{{- end -}}
exec:
  command:
    - bash
    - -c
    - {{ include "graphfleet.headLivenessCommand" . | quote }}
periodSeconds: {{ $p.periodSeconds }}
timeoutSeconds: {{ add (mul 2 $p.timeoutSeconds) 2 }}
failureThreshold: {{ $p.failureThreshold }}
{{- end }}

{{/* (list $ role $groupValues): one KubeRay workerGroupSpec. */}}
{{- define "graphfleet.workerGroup" -}}
{{- $ := index . 0 }}
{{- $role := index . 1 }}
{{- $replicas := index . 2 }}
{{- $w := mergeOverwrite (deepCopy $.Values.workers.common) (deepCopy (index $.Values.workers $role)) }}
{{- $gpus := include "graphfleet.gpusPerPod" (list $ $role) }}
{{- $port := $.Values.config.serve.port -}}
- groupName: {{ $role }}
  replicas: {{ $replicas }}
  minReplicas: {{ $replicas }}
  maxReplicas: {{ $replicas }}
  rayStartParams:
    {{- with $w.rayStartParams }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    num-gpus: {{ $gpus | quote }}
  template:
    metadata:
      labels:
        {{- include "graphfleet.selectorLabels" $ | nindent 8 }}
        app.kubernetes.io/component: {{ $role }}
    spec:
      terminationGracePeriodSeconds: {{ include "graphfleet.terminationGraceSeconds" $ }}
      {{- with $.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "graphfleet.image" $ }}
          imagePullPolicy: {{ $.Values.image.pullPolicy }}
          {{- with $w.env }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            - {name: metrics, containerPort: 8080}
          resources:
            requests:
              {{- with $w.resources.requests }}
              {{- toYaml . | nindent 14 }}
              {{- end }}
              nvidia.com/gpu: {{ $gpus | quote }}
            limits:
              {{- with $w.resources.limits }}
              {{- toYaml . | nindent 14 }}
              {{- end }}
              nvidia.com/gpu: {{ $gpus | quote }}
          # Its ranks serve the head's drain (values.yaml, shutdown).
          lifecycle:
            preStop:
              exec:
                command: ["bash", "-c", {{ include "graphfleet.workerPreStop" $ | quote }}]
          # Passes once the fleet serves: this pod's groups have loaded, JIT-compiled and captured.
          # FQ_RAY_IP (set by KubeRay) is this cluster's head Service, which exposes the Serve port.
          startupProbe:
            exec:
              command:
                - bash
                - -c
                - {{ printf "wget --tries 1 -T %v -q -O /dev/null http://${FQ_RAY_IP}:%v/health" $.Values.startup.timeoutSeconds $port | quote }}
            periodSeconds: {{ $.Values.startup.periodSeconds }}
            timeoutSeconds: {{ add $.Values.startup.timeoutSeconds 1 }}
            failureThreshold: {{ include "graphfleet.startupFailureThreshold" $ }}
          readinessProbe:
            exec:
              command:
                - bash
                - -c
                - {{ printf "%s && wget --tries 1 -T %v -q -O /dev/null http://localhost:%v/-/healthz" (include "graphfleet.rayHealthCommand" $) $.Values.probes.readiness.timeoutSeconds $port | quote }}
            periodSeconds: {{ $.Values.probes.readiness.periodSeconds }}
            timeoutSeconds: {{ add $.Values.probes.readiness.timeoutSeconds 1 }}
            failureThreshold: {{ $.Values.probes.readiness.failureThreshold }}
          livenessProbe:
            {{- include "graphfleet.livenessProbe" $ | nindent 12 }}
          volumeMounts:
            - {name: dshm, mountPath: /dev/shm}
            {{- if $.Values.modelVolume }}
            - {name: models, mountPath: {{ $.Values.modelMountPath }}, readOnly: true}
            {{- end }}
      volumes:
        - name: dshm
          emptyDir: {medium: Memory, sizeLimit: {{ $w.shmSize }}}
        {{- if $.Values.modelVolume }}
        - name: models
          {{- toYaml $.Values.modelVolume | nindent 10 }}
        {{- end }}
      {{- with $w.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $w.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $w.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
