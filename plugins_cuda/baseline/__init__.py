"""The GPU kernels as they were when the first H200 run measured them (commit 57733f7), frozen.

Why a copy: plugins_cuda/bench.py times "before" and "after" in one run on the same card, and
the GPU machine receives a working tree without git history. These files are that commit's
plugins_cuda/{attention_launch,paged_attention,common,kv_codec,aot,fused_qkv}.py with only their
`plugins_cuda.` imports pointed here. Nothing but the benchmark imports them; do not edit.
"""
