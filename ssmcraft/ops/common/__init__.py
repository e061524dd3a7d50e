"""What the kernel families share: the call layout and the PyTorch reference paths
(``reference``), the slot bindings (``slots``, with the slot glossary), tile sizes and buffers
(``tuning``, ``tiles``) and the direct Triton launcher (``launch``)."""
