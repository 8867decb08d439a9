# shellcheck shell=bash
# Sourced by the CI steps under scripts/ci: the one way a step that cannot run here ends.
#
#   ci_skip STEP "needs root and /dev/fuse (...)"
#
# Says "skipped: ..." and exits 0, except under SANFS_REQUIRE_ROOT=1 (scripts/test-all, and so
# CI, sets it) or CI=true, where a step that did not run must not pass: it says FAILED and
# exits 1. The tests' own gate (sanfs_testcluster::skip_unless) follows the same rule.
ci_skip() {
  local step=$1 why=$2
  if [ "${SANFS_REQUIRE_ROOT:-}" = 1 ] || [ -n "${CI:-}" ]; then
    printf '==> %s: FAILED: cannot run here (%s), and SANFS_REQUIRE_ROOT=1 (or CI) says every step must run\n' "$step" "$why" >&2
    exit 1
  fi
  printf '==> %s: skipped: %s (SANFS_REQUIRE_ROOT=1 makes this a failure)\n' "$step" "$why"
  exit 0
}

# ci_need_root STEP WHAT: ci_skip unless root with /dev/fuse and losetup (loop-device LUNs, FUSE).
ci_need_root() {
  if [ "$(id -u)" != 0 ] || [ ! -e /dev/fuse ] || ! command -v losetup >/dev/null; then
    ci_skip "$1" "needs root, /dev/fuse and losetup ($2)"
  fi
}
