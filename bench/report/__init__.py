"""docs/benchmarks.md and its plots from the JSON records of bench/ (``python3 -m bench.report``).

Modules: ``records`` (reading, which records are shown), ``markdown`` (numbers, tables, the numbered commands),
``lengths`` (the maximum trainable length), ``training`` (the other tables of the training runs), ``speed_of_light``
(a step's kernels at the measured attention and matmul rates), ``components`` (the attention op, the matmul rates,
memory tiles, head groups, packed documents, training steps), ``plots``, ``page`` (the page, the entry).
"""
