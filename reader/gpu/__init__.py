"""The device side of reading: the CUDA prefetcher, batch augmentation on the device, and the
dataset held whole on the device."""
