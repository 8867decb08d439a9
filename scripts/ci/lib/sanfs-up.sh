# shellcheck shell=bash
# Sourced by the CI steps under scripts/ci that need a real one-machine sanfs: four loop-device
# LUNs (--direct-io=on) over files in a temp dir, `sanfs-mds format` + `serve` on a free
# loopback port, and one `sanfs-agent mount` (FUSE) of it. Everything made is removed on exit
# (EXIT trap), by exact name or pid: the mount, the agent, the server, the loop devices it
# attached, the temp dir.
#
#   . scripts/ci/lib/sanfs-up.sh
#   sanfs_need_root STEP                  # without root or /dev/fuse: "skipped: ..." and exit 0
#                                         # (exit 1 under SANFS_REQUIRE_ROOT=1: lib/skip.sh)
#   sanfs_build                           # the binaries (profile: $SANFS_CI_PROFILE, see below)
#   sanfs_up STEP LUN_SIZE [MOUNT_OPTS]   # sets SANFS_DIR SANFS_MNT SANFS_ADDR SANFS_LOOPS
#   sanfs_mount_down                      # unmount and wait for the agent (before an fsck)
#   sanfs_fsck                            # stop the server, run `sanfs-mds fsck`
#
# SANFS_CI_PROFILE=debug (default: what `cargo test --workspace` in scripts/test-all already
# built, so nothing is rebuilt) or release (`cargo build --release`, for measurements).
# SANFS_CI_BIN=DIR uses the sanfs-mds and sanfs-agent in DIR and builds nothing.
# SANFS_STRIPE_UNIT (default 64KiB) sets the volume's stripe unit. SANFS_KEEP=1 keeps the temp
# dir (logs, fio JSON) after the step.

sanfs_say() { printf '==> %s: %s\n' "${SANFS_STEP:-sanfs}" "$*"; }

# shellcheck source=scripts/ci/lib/skip.sh
. "$(dirname "${BASH_SOURCE[0]}")/skip.sh"

sanfs_need_root() {
  SANFS_STEP=$1
  ci_need_root "$1" "loop-device LUNs, a FUSE mount"
}

sanfs_build() {
  if [ -n "${SANFS_CI_BIN:-}" ]; then
    SANFS_BIN=$SANFS_CI_BIN
    sanfs_say "using the binaries in $SANFS_BIN (SANFS_CI_BIN), building nothing"
    return 0
  fi
  local profile=${SANFS_CI_PROFILE:-debug}
  case "$profile" in
    debug)
      sanfs_say "building (the build of cargo test --workspace)"
      cargo test --workspace --locked --no-run --quiet 2>&1 | grep -v '^ *Executable' || true
      ;;
    release)
      sanfs_say "building sanfs-mds and sanfs-agent (release)"
      cargo build --release --locked --quiet -p sanfs-metadata-server -p sanfs-client-agent --bins
      ;;
    *) echo "SANFS_CI_PROFILE=$profile: debug or release" >&2; return 1 ;;
  esac
  SANFS_BIN=$PWD/target/$profile
  [ -x "$SANFS_BIN/sanfs-mds" ] && [ -x "$SANFS_BIN/sanfs-agent" ] || {
    echo "${SANFS_STEP}: no binaries in $SANFS_BIN" >&2
    return 1
  }
}

SANFS_DIR=
SANFS_MNT=
SANFS_ADDR=
SANFS_LOOPS=()
SANFS_MDS_PID=
SANFS_AGENT_PID=

sanfs_is_mounted() {
  awk -v m="$1" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo
}

# Unmounts the mount and waits (at most 10 s) for its agent, then kills it by pid.
sanfs_mount_down() {
  if [ -n "$SANFS_MNT" ] && sanfs_is_mounted "$SANFS_MNT"; then
    umount "$SANFS_MNT" 2>/dev/null || umount -l "$SANFS_MNT"
  fi
  if [ -n "$SANFS_AGENT_PID" ]; then
    local _
    for _ in $(seq 100); do kill -0 "$SANFS_AGENT_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SANFS_AGENT_PID" 2>/dev/null || true
    wait "$SANFS_AGENT_PID" 2>/dev/null || true
    SANFS_AGENT_PID=
  fi
  return 0
}

sanfs_mds_down() {
  if [ -n "$SANFS_MDS_PID" ]; then
    kill -TERM "$SANFS_MDS_PID" 2>/dev/null || true
    local _
    for _ in $(seq 100); do kill -0 "$SANFS_MDS_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SANFS_MDS_PID" 2>/dev/null || true
    wait "$SANFS_MDS_PID" 2>/dev/null || true
    SANFS_MDS_PID=
  fi
  return 0
}

# mount(8) hands `-o remount` of a live sanfs mount (type fuse.sanfs) to
# /sbin/mount.fuse.sanfs (else to fuse3's mount.fuse, which cannot do it): link it to our
# agent unless one is installed, and remove the link we made on exit.
SANFS_HELPER_LINK=
sanfs_helper() {
  local h=/sbin/mount.fuse.sanfs
  if [ ! -e "$h" ]; then
    ln -s "$(readlink -f "$SANFS_BIN/sanfs-agent")" "$h" && SANFS_HELPER_LINK=$h
  fi
  return 0
}

sanfs_down() {
  set +e
  sanfs_mount_down
  if [ -n "$SANFS_HELPER_LINK" ]; then rm -f -- "$SANFS_HELPER_LINK"; SANFS_HELPER_LINK=; fi
  sanfs_mds_down
  local l
  for l in "${SANFS_LOOPS[@]}"; do losetup -d "$l"; done
  SANFS_LOOPS=()
  if [ -n "$SANFS_DIR" ] && [ -z "${SANFS_KEEP:-}" ]; then rm -rf -- "$SANFS_DIR"; fi
  if [ -n "${SANFS_KEEP:-}" ]; then sanfs_say "kept $SANFS_DIR (SANFS_KEEP)"; fi
  SANFS_DIR=
}

# Stops the server (after sanfs_mount_down) and checks the metadata store offline.
sanfs_fsck() {
  sanfs_mds_down
  if "$SANFS_BIN/sanfs-mds" fsck --config "$SANFS_DIR/mds.toml" > "$SANFS_DIR/fsck.log" 2>&1; then
    sanfs_say "fsck clean"
  else
    cat "$SANFS_DIR/fsck.log" >&2
    sanfs_say "fsck FAILED"
    return 1
  fi
}

# sanfs_up STEP LUN_SIZE [MOUNT_OPTS]: all three steps below.
sanfs_up() {
  sanfs_luns "$1" "$2" && sanfs_serve && sanfs_mount "${3:-}"
}

# sanfs_luns STEP LUN_SIZE: the temp dir and four loop devices (--direct-io=on) over files in it.
sanfs_luns() {
  SANFS_STEP=$1
  SANFS_LUN_SIZE=$2
  trap sanfs_down EXIT
  trap 'exit 130' INT TERM
  SANFS_DIR=$(mktemp -d "/tmp/sanfs-ci-$SANFS_STEP.XXXXXX")
  chmod 0755 "$SANFS_DIR" # unprivileged users (pjdfstest, bonnie++) reach the mount through it
  local i
  for i in 0 1 2 3; do
    truncate -s "$SANFS_LUN_SIZE" "$SANFS_DIR/lun$i.img"
    SANFS_LOOPS+=("$(losetup -f --show --direct-io=on "$SANFS_DIR/lun$i.img")")
  done
}

# sanfs_serve: `sanfs-mds format` (4-LUN striped volume) and `serve` on a free loopback port
# and on a unix socket in $SANFS_DIR; the agent connects over the socket (same host, known by
# its uid), so no `insecure` is needed.
sanfs_serve() {
  local list
  list=$(printf '"%s", ' "${SANFS_LOOPS[@]}")
  cat > "$SANFS_DIR/mds.toml" <<EOF
[server]
listen = "127.0.0.1:0"
listen_unix = "$SANFS_DIR/mds.sock"
lease_ttl_ms = 10000
[metadata]
path = "$SANFS_DIR/meta.redb"
[volume]
layout = "striped"
stripe_unit = "${SANFS_STRIPE_UNIT:-64KiB}"
devices = [${list%, }]
EOF
  "$SANFS_BIN/sanfs-mds" format --config "$SANFS_DIR/mds.toml" > "$SANFS_DIR/format.log" 2>&1 || {
    cat "$SANFS_DIR/format.log" >&2
    return 1
  }
  NO_COLOR=1 RUST_LOG=warn,sanfs_mds=info "$SANFS_BIN/sanfs-mds" serve --config "$SANFS_DIR/mds.toml" \
    > "$SANFS_DIR/mds.log" 2>&1 &
  SANFS_MDS_PID=$!
  SANFS_ADDR=
  for _ in $(seq 300); do
    SANFS_ADDR=$(sed 's/\x1b\[[0-9;]*m//g' "$SANFS_DIR/mds.log" |
      sed -n 's/.*serving.*addr=\([0-9.]*:[0-9]*\).*/\1/p; s/.*addr=\([0-9.]*:[0-9]*\).*serving.*/\1/p' |
      head -n1)
    [ -n "$SANFS_ADDR" ] && break
    kill -0 "$SANFS_MDS_PID" 2>/dev/null || { cat "$SANFS_DIR/mds.log" >&2; return 1; }
    sleep 0.1
  done
  [ -n "$SANFS_ADDR" ] || { echo "$SANFS_STEP: sanfs-mds did not serve" >&2; cat "$SANFS_DIR/mds.log" >&2; return 1; }
  SANFS_ADDR=unix:$SANFS_DIR/mds.sock
}

# sanfs_mount [OPTIONS]: `sanfs-agent mount --foreground` at $SANFS_DIR/mnt, in the background.
sanfs_mount() {
  local opts=${1:-}
  SANFS_MNT=$SANFS_DIR/mnt
  mkdir "$SANFS_MNT"
  local devices
  devices=$(IFS=:; echo "${SANFS_LOOPS[*]}")
  sanfs_helper
  RUST_LOG=${RUST_LOG:-warn} "$SANFS_BIN/sanfs-agent" mount "$SANFS_ADDR" "$SANFS_MNT" \
    -o "devices=$devices,client_name=ci-$SANFS_STEP${opts:+,$opts}" --foreground \
    < /dev/null > "$SANFS_DIR/agent.log" 2>&1 &
  SANFS_AGENT_PID=$!
  for _ in $(seq 300); do
    sanfs_is_mounted "$SANFS_MNT" && break
    kill -0 "$SANFS_AGENT_PID" 2>/dev/null || { cat "$SANFS_DIR/agent.log" >&2; return 1; }
    sleep 0.1
  done
  sanfs_is_mounted "$SANFS_MNT" || { echo "$SANFS_STEP: the mount did not appear" >&2; return 1; }
  sanfs_say "sanfs on ${SANFS_LOOPS[*]} ($SANFS_LUN_SIZE each, striped ${SANFS_STRIPE_UNIT:-64KiB}), sanfs-mds $SANFS_ADDR, mounted at $SANFS_MNT${opts:+ -o $opts}"
}
