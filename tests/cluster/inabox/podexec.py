"""The first process of a pod's container in process mode, run as
`ip netns exec NS unshare --uts -- python podexec.py SPEC.json`: `ip netns exec` gives it the pod's
network namespace and a mount namespace of its own (mounts made here never reach the machine),
`unshare --uts` a host name of its own. It then does what a container runtime does before it
starts the container's command, and execs that command (so the pod runner's pid is the program's):

1. host name = the pod's name;
2. every directory the image would have and every mount target that does not exist is made in a
   writable layer of the pod's own: an overlay over its nearest existing ancestor (upper and work
   directories under the pod's directory), so nothing is ever created on the machine's filesystem;
   /etc/hosts is bound again from /etc/netns/NS/hosts when /etc gets such a layer; a target inside
   another volume is made in that volume, after it is mounted;
3. each volume is bind-mounted at its mountPath (read-only where the pod says so), parents first,
   from a descriptor opened before any mount (a volume on /tmp must not hide the others' sources);
   then the image's own files (this checkout and the virtualenv, `keep`) that a volume now hides (a
   checkout under /tmp, where the pods mount an emptyDir) are bound back at their paths, as an
   image's files outside its volumes stay visible; hidden means "not the same file", since a restarted
   container finds the empty directory its first start made in the emptyDir;
4. chdir to the working directory and exec the command with exactly the pod's environment.
Standard library only: it runs before anything of the pod is there.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype)]
    if _libc.mount(*args, flags, None if data is None else data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} -> {target} ({fstype}, {data}): {os.strerror(err)}")


def _under(path: str, ancestor: str) -> bool:
    return path != ancestor and path.startswith(ancestor.rstrip("/") + "/")


def _make(path: str, is_file: bool) -> None:
    if is_file:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    else:
        os.makedirs(path, exist_ok=True)


def enter(spec: dict) -> None:
    """Steps 1-3 and the working directory of step 4: what a container runtime does before it starts the
    container's command (the pod's network, mount and UTS namespaces already entered)."""
    socket.sethostname(spec["hostname"])
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Sources are opened first and bound through /proc/self/fd: a volume mounted on /tmp must not hide
    # the others' sources (the pod's directory may well live under /tmp).
    volumes = sorted(spec["mounts"], key=lambda m: m["target"].count("/"))
    sources = {m["source"]: os.open(m["source"], os.O_PATH) for m in volumes}
    keep = {path: os.open(path, os.O_PATH) for path in spec.get("keep", [])}
    targets = [os.path.normpath(m["target"]) for m in volumes]

    def nested(target: str) -> bool:
        return any(t != target and target.startswith(t.rstrip("/") + "/") for t in targets)

    def missing(path: str) -> tuple[str, str] | None:
        """(the real path, its nearest existing ancestor) of a path that does not exist yet."""
        real = os.path.realpath(path)
        if os.path.lexists(real):
            return None
        ancestor = os.path.dirname(real)
        while not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        return real, ancestor

    # The image's directories and the targets outside other volumes: one layer over each nearest existing
    # ancestor, none inside another layer (a layer over /run made after one over /run/x would hide it).
    made = [(p, False) for p in spec["dirs"]]
    made += [(m["target"], os.path.isfile(m["source"])) for m in volumes if not nested(os.path.normpath(m["target"]))]
    todo = [(found, is_file) for p, is_file in made if (found := missing(p))]
    ancestors = {a for (_, a), _ in todo}
    for n, ancestor in enumerate(sorted(a for a in ancestors if not any(_under(a, b) for b in ancestors))):
        upper, work = (os.path.join(spec["layers"], f"{n}-{part}") for part in ("upper", "work"))
        os.makedirs(upper), os.makedirs(work)
        mount("overlay", ancestor, "overlay", 0, f"lowerdir={ancestor},upperdir={upper},workdir={work}")
        if ancestor == "/etc" or _under("/etc", ancestor):
            mount(spec["hosts"], "/etc/hosts", None, MS_BIND)
    for (real, _), is_file in todo:
        _make(real, is_file)
    for m in volumes:
        source = f"/proc/self/fd/{sources[m['source']]}"
        if nested(os.path.normpath(m["target"])) and (found := missing(m["target"])):
            _make(found[0], os.path.isfile(source))  # inside a volume mounted just before: made in that volume
        mount(source, m["target"], None, MS_BIND | MS_REC)
        if m["readOnly"]:
            mount(None, m["target"], None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    for path, fd in keep.items():
        # Hidden by a volume: made in it, and the image's files bound there. The path may already be in the
        # volume, an empty directory left by an earlier start of this container (an emptyDir outlives its
        # containers), so what is there is compared with the image's file, not only looked for.
        if not os.path.exists(path):
            os.makedirs(path)
        if not os.path.samestat(os.stat(path), os.fstat(fd)):
            mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    os.chdir(spec["workdir"])


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    enter(spec)
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except OSError as exc:  # the kubelet's "failed to create containerd task": the pod log says why
        print(f"inabox: the container could not start: {exc}", file=sys.stderr, flush=True)
        sys.exit(128)
