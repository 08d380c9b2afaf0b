#!/usr/bin/python3
"""tools/image_check.py [--keep] — proves deploy/Dockerfile without a container engine (make image-check).

Each stage of the Dockerfile is built in a Debian 12 root made by debootstrap (minbase, cached
under build/image-check/), entered with chroot inside a private mount namespace (unshare -m: /proc,
/sys, /dev, a fresh /dev/shm; nothing stays mounted afterwards). The instructions the Dockerfile
uses are carried out as docker would: FROM debian:12 [AS name], WORKDIR, ENV, COPY . . (the
repository's tracked files, as a clean clone has them), COPY --from=STAGE, RUN, USER; EXPOSE and
ENTRYPOINT are noted. Then:
  - the build stage runs ctest in its build directory (every test but deploy_manifests, whose
    kubectl is not a Debian package);
  - the runtime stage: every binary's shared libraries resolve (ldd), and as the image's USER
    pd-mkmodel writes a model and pd-serve answers a completion on 127.0.0.1.
Each step's output goes to build/image-check/STAGE.log (its tail is printed when it fails).
Any failing step fails the check (exit 1). Needs root (debootstrap, chroot, unshare) and the
Debian mirror; installs debootstrap itself. Progress lines say where it is; about 15 min.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "build", "image-check")
MIRROR = "http://deb.debian.org/debian"
CTEST_EXCLUDE = "deploy_manifests"
t0 = time.time()


def log(msg):
    print("image-check [%4.0fs] %s" % (time.time() - t0, msg), flush=True)


STEP_TIMEOUT = 3600  # s: a step (an install, the build, ctest) that takes longer is hung


def run(cmd, stdout=None, timeout=STEP_TIMEOUT):
    """Runs cmd in its own process group; a nonzero exit or the timeout (the whole group is killed)
    fails the check. Returns the exit status."""
    to_file = hasattr(stdout, "write")  # a log file gets stderr too
    p = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT if to_file else None, start_new_session=True)
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.wait()
        raise SystemExit("image-check: FAILED (no end within %d s): %s" % (timeout, " ".join(cmd)))
    if rc != 0:
        raise SystemExit("image-check: FAILED (exit %d): %s" % (rc, " ".join(cmd)))
    return rc


def parse_dockerfile(path):
    """[(instruction, argument text)] with line continuations joined and comments dropped."""
    out, cur = [], ""
    for line in open(path):
        s = line.rstrip("\n")
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        ins, _, arg = cur.strip().partition(" ")
        out.append((ins.upper(), arg.strip()))
        cur = ""
    return out


def base_root():
    """A cached debootstrap of bookworm (minbase): the FROM debian:12 of every stage."""
    cache = os.path.join(WORK, "debian12-minbase.tar")
    if not os.path.exists(cache):
        if shutil.which("debootstrap") is None:
            log("installing debootstrap (apt)")
            run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "debootstrap"],
                stdout=subprocess.DEVNULL)
        tmp = os.path.join(WORK, "debootstrap")
        shutil.rmtree(tmp, ignore_errors=True)
        log("debootstrap --variant=minbase bookworm (once; cached in %s)" % cache)
        run(["debootstrap", "--variant=minbase", "bookworm", tmp, MIRROR], stdout=subprocess.DEVNULL)
        run(["tar", "-C", tmp, "-cf", cache + ".tmp", "."])
        os.rename(cache + ".tmp", cache)
        shutil.rmtree(tmp)
    return cache


# The host's certificate bundle, visible in the chroot at /run/host-ca.crt for the test step: the
# tests fetch npm packages over https, and where egress goes through a TLS-inspecting proxy (as
# here) only the host's bundle knows its CA. Test-environment plumbing, as `docker build --secret`
# would be; nothing of it enters an image stage.
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"


def chroot_sh(root, script, user=None, env=None, popen=False, log_to=None, host_ca=False):
    """Runs script with /bin/sh in root, in a private mount namespace with /proc, /sys, /dev and a
    fresh /dev/shm mounted, /etc/resolv.conf and /etc/hosts as a container runtime writes them; as user (uid:gid) when given; output to log_to (a path) when given
    (its tail is printed if the script fails); with host_ca, HOST_CA at /run/host-ca.crt."""
    env = dict(env or {})
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("HOME", "/root" if user is None else "/tmp")
    env.setdefault("DEBIAN_FRONTEND", "noninteractive")
    r = shlex.quote(root)
    exports = " ".join("%s=%s" % (k, shlex.quote(v)) for k, v in env.items())
    spec = "--userspec=%s " % user if user else ""
    ca = ""
    if host_ca and os.path.exists(HOST_CA):
        open(root + "/run/host-ca.crt", "a").close()
        ca = "mount --bind %s %s/run/host-ca.crt; " % (HOST_CA, r)
        exports += " NODE_EXTRA_CA_CERTS=/run/host-ca.crt npm_config_cafile=/run/host-ca.crt"
    outer = ("set -e; mount -t proc proc {r}/proc; mount -t sysfs sys {r}/sys; mount --rbind /dev {r}/dev; "
             "mount -t tmpfs -o size=2g tmpfs {r}/dev/shm; cp /etc/resolv.conf {r}/etc/resolv.conf; "
             "printf '127.0.0.1\\tlocalhost\\n::1\\tlocalhost ip6-localhost ip6-loopback\\n' > {r}/etc/hosts; {ca}"
             "exec env -i {exports} chroot {spec}{r} /bin/sh -c {script}").format(
        r=r, exports=exports, spec=spec, script=shlex.quote(script), ca=ca)
    cmd = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", outer]
    if popen:
        return subprocess.Popen(cmd, start_new_session=True)
    if log_to is None:
        run(cmd)
        return
    with open(log_to, "ab") as out:
        try:
            run(cmd, stdout=out)
        except SystemExit:
            with open(log_to, errors="replace") as f:
                sys.stdout.write(f.read()[-6000:])
            print("image-check: the whole log: %s" % log_to)
            raise


def tracked_files():
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


def build_stages(dockerfile):
    stages, cur = {}, None
    env = {}
    for ins, arg in parse_dockerfile(dockerfile):
        if ins == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?$", arg, re.I)
            if m is None or m.group(1) not in ("debian:12", "debian:bookworm"):
                raise SystemExit("image-check: FROM %s: only debian:12 stages can be built here" % arg)
            name = m.group(2) or "stage%d" % len(stages)
            root = os.path.join(WORK, name)
            log("stage %s: FROM %s" % (name, m.group(1)))
            if os.path.exists(root):
                run(["rm", "-rf", "--one-file-system", root])
            if os.path.exists(os.path.join(WORK, name + ".log")):
                os.remove(os.path.join(WORK, name + ".log"))
            os.makedirs(root)
            run(["tar", "-C", root, "-xf", base_root()])
            cur = {"name": name, "root": root, "workdir": "/", "user": None}
            stages[name] = cur
            env = {}
        elif ins == "WORKDIR":
            cur["workdir"] = arg
            os.makedirs(cur["root"] + arg, exist_ok=True)
        elif ins == "ENV":
            k, _, v = arg.partition("=") if "=" in arg else arg.partition(" ")
            env[k.strip()] = v.strip()
        elif ins == "COPY" and arg.startswith("--from="):
            src_stage, src, dst = re.match(r"--from=(\S+)\s+(\S+)\s+(\S+)$", arg).groups()
            log("stage %s: COPY --from=%s %s %s" % (cur["name"], src_stage, src, dst))
            s = stages[src_stage]["root"] + src
            d = cur["root"] + (dst if dst.startswith("/") else os.path.join(cur["workdir"], dst))
            os.makedirs(d, exist_ok=True)
            run(["cp", "-a", s.rstrip("/") + "/." if os.path.isdir(s) else s, d])
        elif ins == "COPY":
            if arg.split() != [".", "."]:
                raise SystemExit("image-check: COPY %s: only 'COPY . .' and 'COPY --from' are supported" % arg)
            files = tracked_files()
            log("stage %s: COPY . . (%d tracked files)" % (cur["name"], len(files)))
            dst = cur["root"] + cur["workdir"]
            for f in files:
                if os.path.lexists(os.path.join(ROOT, f)):
                    os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
                    shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f), follow_symlinks=False)
        elif ins == "RUN":
            log("stage %s: RUN %s" % (cur["name"], arg[:150] + ("..." if len(arg) > 150 else "")))
            chroot_sh(cur["root"], "cd %s && %s" % (shlex.quote(cur["workdir"]), arg), env=env,
                      log_to=os.path.join(WORK, cur["name"] + ".log"))
        elif ins == "USER":
            cur["user"] = arg
        elif ins in ("EXPOSE", "ENTRYPOINT", "CMD", "LABEL"):
            log("stage %s: %s %s (noted)" % (cur["name"], ins, arg))
        else:
            raise SystemExit("image-check: %s is not supported here" % ins)
    return stages


def test_build_stage(stage):
    log("stage %s: ctest in %s/build (all but %s)" % (stage["name"], stage["workdir"], CTEST_EXCLUDE))
    log_to = os.path.join(WORK, stage["name"] + "-ctest.log")
    if os.path.exists(log_to):
        os.remove(log_to)
    chroot_sh(stage["root"], "cd %s/build && ctest --output-on-failure -j2 -E %s" %
              (shlex.quote(stage["workdir"]), CTEST_EXCLUDE), env={"UCX_MEM_EVENTS": "no"}, log_to=log_to,
              host_ca=True)
    with open(log_to, errors="replace") as f:
        summary = [line for line in f if "tests passed" in line or "Total Test time" in line]
    log("stage %s: %s" % (stage["name"], " ".join(x.strip() for x in summary)))


def test_runtime_stage(stage):
    root, user = stage["root"], stage["user"] or "0"
    uid = user.split(":")[0]
    log("stage %s: shared libraries of every binary resolve" % stage["name"])
    chroot_sh(root, 'for b in /usr/local/bin/*; do ldd "$b" | grep "not found" && exit 1; done; exit 0')
    log("stage %s: as uid %s, pd-mkmodel writes a model and pd-serve answers a completion" % (stage["name"], uid))
    os.makedirs(root + "/tmp/smoke", exist_ok=True)
    os.chown(root + "/tmp/smoke", int(uid), int(uid))
    port_file = root + "/tmp/smoke/port"
    p = chroot_sh(root, "pd-mkmodel --preset tiny --out /tmp/smoke/m >/dev/null && exec pd-serve --model "
                  "/tmp/smoke/m --host 127.0.0.1 --port 0 --port-file /tmp/smoke/port --kv-cache-memory 256M",
                  user="%s:%s" % (uid, uid), popen=True)
    try:
        end = time.time() + 120
        while not os.path.exists(port_file) and time.time() < end and p.poll() is None:
            time.sleep(0.2)
        if not os.path.exists(port_file):
            raise SystemExit("image-check: FAILED: pd-serve did not start in the runtime stage")
        port = int(open(port_file).read())
        req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port,
                                     data=json.dumps({"prompt": "image check", "max_tokens": 4}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        if out["usage"]["completion_tokens"] != 4:
            raise SystemExit("image-check: FAILED: the completion has %s tokens" % out["usage"])
        log("stage %s: completion ok (%r)" % (stage["name"], out["choices"][0]["text"]))
    finally:
        try:
            os.killpg(p.pid, 15)
            p.wait(timeout=30)
        except Exception:
            os.killpg(p.pid, 9)


def main():
    if os.geteuid() != 0:
        raise SystemExit("image-check: needs root (debootstrap, chroot, unshare)")
    os.makedirs(WORK, exist_ok=True)
    stages = build_stages(os.path.join(ROOT, "deploy", "Dockerfile"))
    names = list(stages)
    test_build_stage(stages[names[0]])
    test_runtime_stage(stages[names[-1]])
    if "--keep" not in sys.argv:
        for s in stages.values():
            run(["rm", "-rf", "--one-file-system", s["root"]])
    log("passed: every stage of deploy/Dockerfile built, the build stage's tests pass, the runtime stage serves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
