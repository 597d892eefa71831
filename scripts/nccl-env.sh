# Sourced by the GPU scripts: makes libnccl loadable for the EP group (capturable_moe::ep).
# cudarc 0.19 opens "libnccl.so" (never "libnccl.so.2"), and the NCCL that GPU machines carry
# usually comes as a PyTorch venv's nvidia-nccl wheel, which ships only libnccl.so.2; so this
# finds a libnccl.so.2 (a venv's nvidia/nccl/lib first, then the loader cache), links
# libnccl.so to it in a private folder and puts both folders on LD_LIBRARY_PATH. It then sets
# CAPMOE_REQUIRE_NCCL=1, so the NCCL tests fail rather than skip. Finding none changes nothing
# (the NCCL tests then print "skipping: libnccl not found").
capmoe_find_nccl() {
  local dir
  # Globs, not versions: whichever Python the venv has.
  for dir in /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib \
             /opt/*/.venv/lib/python3*/site-packages/nvidia/nccl/lib \
             /usr/local/lib/python3*/dist-packages/nvidia/nccl/lib \
             /usr/lib/python3/dist-packages/nvidia/nccl/lib; do
    [[ -e "$dir/libnccl.so.2" ]] && { echo "$dir/libnccl.so.2"; return; }
  done
  { ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{ print $NF; exit }'; } || true
}
capmoe_nccl_lib="$(capmoe_find_nccl)"
if [[ -n "$capmoe_nccl_lib" ]]; then
  capmoe_nccl_link="${TMPDIR:-/tmp}/capmoe-nccl-$(id -u)"
  mkdir -p "$capmoe_nccl_link"
  ln -sfn "$capmoe_nccl_lib" "$capmoe_nccl_link/libnccl.so"
  export LD_LIBRARY_PATH="$capmoe_nccl_link:$(dirname "$capmoe_nccl_lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CAPMOE_REQUIRE_NCCL=1
  echo "nccl-env: libnccl.so -> $capmoe_nccl_lib (in $capmoe_nccl_link)" >&2
else
  echo "nccl-env: no libnccl.so.2 found; the NCCL tests will skip" >&2
fi
unset -f capmoe_find_nccl
# NVLink multicast (NVLS) stays off: the multi-GPU machines lent here share their host's GPUs,
# and a program that uses multicast can take them out of service. The machines set these; a
# caller's own environment must not undo them.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset capmoe_nccl_lib capmoe_nccl_link
