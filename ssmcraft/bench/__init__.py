"""``ssmcraft bench``: time what users call (``obj(inputs)``, its CUDA-graphed form, or the mixer
layer built on it) against the HBM floor (``run``), and its command line (``commands``)."""
