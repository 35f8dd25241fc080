"""The cluster in a box (issue #13): Kubernetes clusters emulated on this machine, whose pods run as
processes or as podman containers of the built images (each in a network namespace of its own),
started by a pod runner that plays the kubelet and the workload controllers. Test support, not
product; tests/cluster/ uses it, docs/kubernetes.md says what it stands for and what only a real
cluster shows.

    box.py         clusters, S3 and WAN links on one testbed
    apiserver.py   a cluster's API server: tests/operator/cluster.py's emulator, TLS on the bridge,
                   service-account tokens, RBAC, CRD-served kinds
    runner.py      one cluster's loop: controllers, kubelet, DNS, status
    controllers.py Deployment / StatefulSet plans, workload status, Service names (pure)
    kubelet.py     a pod's volumes, environment, process, probes, restarts, status
    podexec.py     the first process of a container (process mode): mounts in its own mount namespace, exec
    zygote.py      rlfleet containers forked from a process that imported their code once (process mode)
    oci.py         a pod's container as `podman run` of its image (container mode, issue #18)
    images.py      what an image is when a pod runs as processes
    netns.py       sockets in another network namespace: probes, port forwards, the API on the bridge
    helm.py        `helm install` with the real Helm SDK
"""

from .box import Box, Cluster

__all__ = ["Box", "Cluster"]
