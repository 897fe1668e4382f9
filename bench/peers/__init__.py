"""The reference Llama trained side by side by this project and by its two peers; one JSON record per run.

    python3 -m bench.peers --system fpdt --model llama3-8b --layers 4 --seq-len 262144 --ballast auto --check-host
    torchrun --standalone --nproc_per_node 4 -m bench.peers --system ring --model llama3-8b --layers 4 --seq-len 262144
    python3 -m bench.peers --max-length --gpus 4 --system fpdt --model llama3-8b --layers 4 --seq-len 524288 \\
        --ballast auto --check-host --steps 1                 # launches one torchrun per length

Systems, all on ``lightning_fpdt.models.llama.LlamaForCausalLM`` with the same initialisation (``LlamaLM``'s seeded
init) and the same random-token data (sample ``i`` drawn from a generator seeded with ``i``), AdamW, FSDP2 over all
GPUs with bf16 compute and fp32 master weights and gradient reduction (FSDP2's ``MixedPrecisionPolicy`` in all three):

- ``fpdt``: ``Trainer(strategy=FPDTStrategy(...))`` with ``ActivationOffload``, ``TiledMLP``, ``TiledLoss`` and
  ``MFUMonitor``, attention chunks offloaded to host memory (``--offload on``): every feature of this project. The
  GPUs share one sequence (Ulysses + FPDT); a step trains ``S`` tokens.
- ``modelparallel``: what a Lightning user writes without this project: ``ModelParallelStrategy`` (data parallel
  only), FSDP2 and torch's non-reentrant activation checkpointing per block in ``configure_model``, the reference
  Llama's SDPA attention, untiled loss. Every GPU holds a whole sequence of ``S`` tokens (its own sample): a step
  trains ``GPUs × S`` tokens, and the longest sequence does not grow with the GPU count.
- ``ring``: PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``: ring attention
  over SDPA, head-tail load balancing by the API) on a 1-D mesh of all GPUs, FSDP2 over the same mesh, each block
  checkpointed; a plain PyTorch loop, as its users write it. ``input_ids``, ``position_ids`` and the globally shifted
  labels are the buffers it shards. CUDA only: torch dispatches only its CUDA SDPA kernels to ring attention (on CPU
  ``aten._scaled_dot_product_flash_attention_for_cpu`` "does not have a sharding strategy registered").

Modules: ``cli`` (options, entry), ``systems`` (the three systems), ``ballast`` (the layers not run and the host
check), ``runner`` (one run on every rank), ``records`` (the JSON record and the ranks' agreement on its status),
``search`` (``--max-length``). The ballast protocol and the record's fields: bench/README.md.
"""
