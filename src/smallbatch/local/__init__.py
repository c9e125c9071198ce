"""Aids of a study run on this machine: the console of `snakemake --logger smallbatch`, the warm-start
server and the GPU allocator."""
