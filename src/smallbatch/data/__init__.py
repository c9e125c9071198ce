"""The data sets: their registry, their files read by the real loaders, the digest of what they hold,
caches and subsets, the composite pairs, and the augmentations that make two views."""
