#!/usr/bin/env bash
# Installs Slurm (slurmctld, slurmd, the client commands) and munge from the distribution's
# packages, for the test suite's throwaway two-node cluster (tests/test_slurm.py). Nothing is
# configured or started here: the test fixture writes its own slurm.conf and munge key and
# runs the daemons inside network namespaces. Idempotent and quiet; does nothing (exit 0)
# when the commands are already there. Needs root and apt-get; without them it says so in
# one line and the Slurm tests skip with the reason.
set -euo pipefail
NEEDED=(slurmctld slurmd sbatch srun squeue scancel sinfo scontrol munged)
missing=()
for cmd in "${NEEDED[@]}"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-slurm: not root or no apt-get; the Slurm tests will skip (missing: ${missing[*]})" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt_install() {
  # no service is started by the install: the packages' init scripts go through
  # policy-rc.d, and a machine without a running init starts nothing anyway
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}
if ! apt_install 2>/dev/null; then
  apt-get update -qq >/dev/null && apt_install || { echo "setup-slurm: apt-get could not install slurm; the Slurm tests will skip" >&2; exit 0; }
fi
