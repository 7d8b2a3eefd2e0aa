"""`python -m runtime.gateway`: the gateway alone (what `trtserve serve` starts next to tritonserver)."""

from runtime.gateway.cli import gateway

gateway(prog_name="trtserve gateway")
