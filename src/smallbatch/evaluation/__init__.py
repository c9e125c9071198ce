"""A pretrained backbone judged: frozen features, kNN and linear probes, few-label probes, the
kNN monitor during training and the supervised baseline."""
