"""The Pod Security Standards' `baseline` and `restricted` profiles as checks on a pod spec.

Written from the Kubernetes documentation, "Pod Security Standards"
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, Kubernetes 1.33), control by control:
each check below names the control it implements. `restricted` includes `baseline`. A namespace labelled
`pod-security.kubernetes.io/enforce: restricted` rejects a pod for which `violations(…)` is not empty.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Obj = dict[str, Any]

# Baseline, "Capabilities": the only capabilities a container may add.
BASELINE_ADDABLE = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# Baseline, "SELinux": allowed `seLinuxOptions.type` values (empty: undefined).
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# Baseline, "Sysctls": the safe set.
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
# Restricted, "Volume Types": the only volume sources allowed.
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
SECCOMP_OK = frozenset({"RuntimeDefault", "Localhost"})


def _containers(pod: Obj) -> Iterator[tuple[str, Obj]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for ctr in pod.get(field) or []:
            yield f"{field}[{ctr['name']}]", ctr


def baseline_violations(pod: Obj, annotations: Obj | None = None) -> list[str]:
    """Every `baseline` control `pod` (a PodSpec) breaks, as "where: what" lines."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    # HostProcess
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("spec.securityContext: windowsOptions.hostProcess")
    # Host Namespaces
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"spec.{field}")
    # HostPath Volumes
    for vol in pod.get("volumes") or []:
        if "hostPath" in vol:
            out.append(f"volumes[{vol['name']}]: hostPath")
    # Sysctls
    for sysctl in psc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"spec.securityContext: sysctl {sysctl['name']}")
    # AppArmor (field and the older annotations)
    if (psc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in {"RuntimeDefault", "Localhost"}:
        out.append("spec.securityContext: appArmorProfile")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"annotation {key}={value}")
    # SELinux
    contexts = [("spec.securityContext", psc), *((w, c.get("securityContext") or {}) for w, c in _containers(pod))]
    for where, ctx in contexts:
        se = ctx.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}: seLinuxOptions {se}")
    # Seccomp (baseline: never Unconfined)
    if (psc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("spec.securityContext: seccompProfile Unconfined")
    for where, ctr in _containers(pod):
        ctx = ctr.get("securityContext") or {}
        # HostProcess
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: windowsOptions.hostProcess")
        # Privileged Containers
        if ctx.get("privileged"):
            out.append(f"{where}: privileged")
        # Capabilities
        added = set((ctx.get("capabilities") or {}).get("add") or []) - BASELINE_ADDABLE
        if added:
            out.append(f"{where}: adds {sorted(added)}")
        # Host Ports
        for port in ctr.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']}")
        # AppArmor
        if (ctx.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in {"RuntimeDefault", "Localhost"}:
            out.append(f"{where}: appArmorProfile")
        # /proc Mount Type
        if ctx.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount {ctx['procMount']}")
        # Seccomp
        if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}: seccompProfile Unconfined")
    return out


def restricted_violations(pod: Obj, annotations: Obj | None = None) -> list[str]:
    """Every `restricted` control (baseline included) `pod` (a PodSpec) breaks, as "where: what" lines."""
    out = baseline_violations(pod, annotations)
    psc = pod.get("securityContext") or {}
    # Volume Types
    for vol in pod.get("volumes") or []:
        sources = set(vol) - {"name"}
        if not sources <= RESTRICTED_VOLUMES:
            out.append(f"volumes[{vol['name']}]: {sorted(sources - RESTRICTED_VOLUMES)}")
    # Running as Non-root user: runAsUser never 0 (pod and containers)
    if psc.get("runAsUser") == 0:
        out.append("spec.securityContext: runAsUser 0")
    pod_non_root = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in SECCOMP_OK
    for where, ctr in _containers(pod):
        ctx = ctr.get("securityContext") or {}
        # Privilege Escalation: must be set to false
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        # Running as Non-root: true on the pod or the container, never false on a container
        non_root = ctx.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"{where}: runAsNonRoot is not true")
        if ctx.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")
        # Seccomp: RuntimeDefault or Localhost on the pod or on every container
        seccomp = (ctx.get("seccompProfile") or {}).get("type")
        if not (seccomp in SECCOMP_OK or (seccomp is None and pod_seccomp)):
            out.append(f"{where}: seccompProfile is not RuntimeDefault or Localhost")
        # Capabilities: drop ALL, add at most NET_BIND_SERVICE
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: does not drop ALL capabilities")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
    return out
