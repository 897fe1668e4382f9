"""The reference Llama trained side by side by this project and by its peers; one JSON record per run.

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

Two more systems train the same geometry as a Hugging Face ``transformers`` Llama (built from the named geometry at
random, transformers' seeded init; DeepSpeed and transformers are imported only when they run):

- ``fpdt-hf``: ``fpdt`` on the Hugging Face Llama (the strategy's ``"fpdt"`` attention and loss in transformers),
  the same strategy and callbacks.
- ``alst``: DeepSpeed's Arctic Long Sequence Training recipe: Ulysses over SDPA, TiledMLP, tiled logits and loss,
  checkpointed layer inputs offloaded to the host, ZeRO-3 (bench/peers/alst.py lists every departure).

``python3 -m bench.peers.deepspeed_fpdt`` measures DeepSpeed's FPDT attention op alone (``kind: attention`` records
of system ``deepspeed-fpdt``), as bench/attention.py measures this project's.

Modules: ``cli`` (options, entry), ``systems`` (the systems), ``alst``, ``hf_llama`` (the Hugging Face Llama),
``deepspeed_fpdt`` and ``flash_shim`` (DeepSpeed's FPDT op on PyTorch's FlashAttention-2), ``ballast`` (the layers
not run and the host check), ``runner`` (one run on every rank), ``records`` (the JSON record and the ranks'
agreement on its status), ``search`` (``--max-length``), ``torch_api_audit`` (the torch names a peer's sources need
that the installed torch lacks). The ballast protocol and the record's fields: bench/README.md.
"""
