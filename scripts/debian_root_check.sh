#!/usr/bin/env bash
# Proves the README's quick start on a minimal Debian 12: makes a bookworm root from Debian's
# archive (mmdebstrap, variant minbase: no compiler, no Python, no CUDA), puts a clean clone
# of this checkout's HEAD in /root/dtrain and runs, chrooted, exactly the two commands of
# README.md's "Quick start":
#     bash scripts/quickstart.sh
#     bash scripts/test.sh
# then reports the time of each, the last line of the training (test accuracy), the ctest
# summary, the tests that reported a skip, and that the build configured without CUDA.
# Run as root on a Debian/Ubuntu host with network access to deb.debian.org and PyPI.
#
#   scripts/debian_root_check.sh [--root DIR] [--keep] [--reuse] [--quick] [--commit REV]
#                                [--train-args "ARGS"] [--test-args "ARGS"]
#   --root DIR     where the root is made (default /var/tmp/dtrain-debian12); the log is DIR.log
#   --keep         keep the root afterwards (default: removed)
#   --reuse        iteration only: reuse a root this script made and kept (its packages stay
#                  installed), with a fresh clone; the proof is a run without --reuse
#   --quick        a short check: quickstart with --set train.max_steps=50 (warmup 10) and the tests
#                  that run outside tools (srun, mpirun, torchrun, prometheus, tar, python readers)
#   --commit REV   test that commit of this checkout instead of HEAD
#   --train-args   extra `dtrain train` arguments for quickstart.sh (replace --quick's)
#   --test-args    ctest arguments for test.sh (replace --quick's)
# Only committed files are tested (uncommitted changes are named in a warning). The chroot
# shares this machine's network; its processes run in their own PID and mount namespaces,
# so daemons a test leaves behind and the /proc, /sys, /dev mounts end with it.
set -euo pipefail
ROOT=/var/tmp/dtrain-debian12 REV=HEAD KEEP=0 REUSE=0 QUICK=0 TRAIN_ARGS="" TEST_ARGS="" SET_TRAIN=0 SET_TEST=0
SUITE=bookworm MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
die() { echo "debian_root_check: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --root) [ $# -ge 2 ] || die "--root needs a directory"; ROOT=$2; shift ;;
    --keep) KEEP=1 ;;
    --reuse) REUSE=1; KEEP=1 ;;
    --quick) QUICK=1 ;;
    --commit) [ $# -ge 2 ] || die "--commit needs a revision"; REV=$2; shift ;;
    --train-args) [ $# -ge 2 ] || die "--train-args needs a value"; TRAIN_ARGS=$2; SET_TRAIN=1; shift ;;
    --test-args) [ $# -ge 2 ] || die "--test-args needs a value"; TEST_ARGS=$2; SET_TEST=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
if [ "$QUICK" = 1 ]; then
  [ "$SET_TRAIN" = 1 ] || TRAIN_ARGS="--set train.max_steps=50 --set schedule.warmup_steps=10 --set run.name=quick"
  [ "$SET_TEST" = 1 ] || TEST_ARGS="-R 'real mpirun|real Slurm srun|torchrun|Prometheus|promtool|GNU tar|sha256sum|webdataset|tensorboard|GPT2LMHeadModel|tiktoken|torchvision.models.resnet18|SIGKILL of a worker'"
fi
[ "$(id -u)" -eq 0 ] || die "run as root (mmdebstrap, mount and chroot need it)"
case "$ROOT" in /|/bin*|/boot*|/dev*|/etc*|/home|/lib*|/proc*|/root|/sbin*|/sys*|/usr*|/var|"") die "--root '$ROOT' is a system directory" ;; esac
ROOT=$(realpath -m "$ROOT")
SRC=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
HEAD=$(git -C "$SRC" rev-parse --verify "$REV^{commit}") || die "--commit '$REV' is not a commit of $SRC"
LOG="$ROOT.log"
MARK="$ROOT/.dtrain-debian-root"
exec > >(tee "$LOG") 2>&1
stamp() { date +%s; }
hms() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }
T0=$(stamp)

cleanup() {
  local rc=$?
  if [ "$KEEP" = 0 ] && [ -f "$MARK" ]; then
    # the mounts live in the chroot's own mount namespace and are gone; never follow a mount
    if findmnt -rn -o TARGET | grep -q "^$ROOT/"; then
      echo "debian_root_check: something is still mounted under $ROOT; not removing it"
    else
      rm -rf --one-file-system "$ROOT"
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

echo "== debian_root_check: $SUITE root in $ROOT, clone of $SRC at $HEAD"
if [ -n "$(git -C "$SRC" status --porcelain --untracked-files=no)" ]; then
  echo "warning: $SRC has uncommitted changes; only the commit $HEAD is tested"
fi

# ---- 1. the root ----
t=$(stamp)
if [ "$REUSE" = 1 ] && [ -f "$MARK" ]; then
  echo "== reusing the root made $(cat "$MARK") (--reuse: not a proof)"
else
  if [ -e "$ROOT" ]; then
    [ -f "$MARK" ] || die "$ROOT exists and was not made by this script; remove it or pick another --root"
    rm -rf --one-file-system "$ROOT"
  fi
  command -v mmdebstrap >/dev/null || {
    echo "== installing mmdebstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  }
  echo "== mmdebstrap --variant=minbase $SUITE from $MIRROR"
  mkdir -p "$ROOT"
  date -u +%FT%TZ > "$MARK"  # before mmdebstrap, so that cleanup may remove a half-made root
  nice mmdebstrap --quiet --variant=minbase --mode=root --skip=check/empty "$SUITE" "$ROOT" \
    "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
    "deb ${MIRROR%/debian}/debian-security $SUITE-security main"
  date -u +%FT%TZ > "$MARK"
fi
# What Debian's installer writes and a minbase root lacks: the host name resolves.
printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' "$(hostname)" \
  > "$ROOT/etc/hosts"
hostname > "$ROOT/etc/hostname"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
# This machine's own network setup, not the project's: a TLS-intercepting egress proxy's CA
# (trusted once setup.sh installs ca-certificates) and pip's configuration pointing at it.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  mkdir -p "$ROOT/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
  echo "== copied this host's local CA certificates: $(cd /usr/local/share/ca-certificates && echo *.crt)"
fi
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$ROOT/etc/pip.conf" && echo "== copied this host's /etc/pip.conf"
T_ROOT=$(($(stamp) - t))
echo "== root ready in $(hms $T_ROOT) ($(du -sh --one-file-system "$ROOT" | cut -f1))"

# ---- 2. a clean clone of HEAD ----
rm -rf "$ROOT/root/dtrain"
git clone -q --no-hardlinks --no-checkout "$SRC" "$ROOT/root/dtrain"
git -C "$ROOT/root/dtrain" -c advice.detachedHead=false checkout -q "$HEAD"
git -C "$ROOT/root/dtrain" remote remove origin  # its path does not exist inside the root
echo "== /root/dtrain: $(git -C "$ROOT/root/dtrain" log -1 --format='%h %s' | cut -c1-100)"

# ---- 3. the two commands, chrooted ----
# in_root CMD: runs CMD with bash in /root/dtrain of the root, with a clean environment, in
# new PID and mount namespaces (a fresh /proc; /sys with its submounts, /dev, /dev/pts bound;
# its own /dev/shm).
in_root() {
  nice -n 5 unshare --pid --fork --mount --propagation private -- bash -c '
    set -e
    R=$1 CMD=$2
    mounted=()
    undo() { for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" || true; done; }
    trap undo EXIT
    mnt() { local dst=${*: -1}; mount "$@"; mounted+=("$dst"); }
    mnt -t proc proc "$R/proc"
    mnt --rbind /sys "$R/sys"  # with /sys/fs/cgroup: slurmd will not start without it
    mnt --bind /dev "$R/dev"
    mnt --bind /dev/pts "$R/dev/pts"
    mnt -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/dev/shm"
    chroot "$R" /usr/bin/env -i HOME=/root USER=root LOGNAME=root SHELL=/bin/bash TERM=dumb \
      PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      /bin/bash -c "cd /root/dtrain && $CMD"
  ' in_root "$ROOT" "$1"
}

QS_CMD="bash scripts/quickstart.sh${TRAIN_ARGS:+ $TRAIN_ARGS}"
TS_CMD="bash scripts/test.sh${TEST_ARGS:+ $TEST_ARGS}"
echo "== [chroot] $QS_CMD"
t=$(stamp)
set +e; in_root "$QS_CMD" 2>&1 | tee "$ROOT.quickstart.log"; QS_RC=${PIPESTATUS[0]}; set -e
T_QS=$(($(stamp) - t))
echo "== quickstart exit $QS_RC after $(hms $T_QS)"
echo "== [chroot] $TS_CMD"
t=$(stamp)
set +e; in_root "$TS_CMD" 2>&1 | tee "$ROOT.test.log"; TS_RC=${PIPESTATUS[0]}; set -e
T_TS=$(($(stamp) - t))
echo "== test.sh exit $TS_RC after $(hms $T_TS)"

# ---- 4. what the runs showed ----
B="$ROOT/root/dtrain/build"
CUDA_LINE=$(grep -h "dtrain: CUDA backend" "$ROOT/root/dtrain/build.cmake.log" 2>/dev/null | tail -1 || true)
INFO=$(in_root "./build/dtrain info" 2>&1 || true)
ACC_LINE=$(grep -a "^done:" "$ROOT.quickstart.log" | tail -1 || true)
CTEST_LINE=$(grep -aE "tests passed, [0-9]+ tests? failed out of" "$ROOT.test.log" | tail -1 || true)
# every test whose output (ctest keeps all of it in LastTest.log) has a doctest MESSAGE
# starting "skipped"/"SKIPPED": one line per message, with its count and (up to 3) tests
SKIPS=$(awk '/^[0-9]+\/[0-9]+ Test: /{sub(/^[0-9]+\/[0-9]+ Test: /, ""); name=$0}
             /MESSAGE: (skipped|SKIPPED)/ {msg=$0; sub(/^.*MESSAGE: /, "", msg); print msg "\t" name}' \
          "$B/Testing/Temporary/LastTest.log" 2>/dev/null | sort -u |
        awk -F'\t' '{n[$1]++; if (n[$1] <= 3) t[$1] = t[$1] (n[$1] > 1 ? "; " : "") $2}
                    END {for (m in n) printf "  %d x %s  [%s%s]\n", n[m], m, t[m], (n[m] > 3 ? "; ..." : "")}' || true)
echo
echo "==================== debian_root_check summary ===================="
echo "commit:        $HEAD"
echo "root:          Debian $(cat "$ROOT/etc/debian_version") minbase, made in $(hms $T_ROOT)"
echo "quickstart:    exit $QS_RC in $(hms $T_QS): ${ACC_LINE:-<no 'done:' line>}"
echo "test.sh:       exit $TS_RC in $(hms $T_TS): ${CTEST_LINE:-<no ctest summary>}"
echo "cmake:         ${CUDA_LINE:-<no 'dtrain: CUDA backend' line>}"
echo "dtrain info:"; echo "$INFO" | sed 's/^/  /'
echo "skips reported by tests:"; echo "${SKIPS:-  (none)}"
echo "total:         $(hms $(($(stamp) - T0)))   log: $LOG"
echo "==================================================================="
[ "$QS_RC" = 0 ] && [ "$TS_RC" = 0 ] && [ -n "$ACC_LINE" ] && [ -n "$CTEST_LINE" ] &&
  echo "$CUDA_LINE" | grep -q "CUDA backend OFF"
