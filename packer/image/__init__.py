"""One image to one record: the pre-transform (EXIF, RGB, resize, crop), its resamplers, the crop-aware
JPEG decode, and the encoding of the result."""
