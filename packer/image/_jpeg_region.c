/* Decode one rectangle of a JPEG with libjpeg-turbo, leaving the rest of the output buffer untouched.
 *
 * Why: the pre-transform's center crop throws away a third or more of a landscape photo, yet a full
 * decode runs the inverse DCT, chroma upsampling and colour conversion on every pixel. libjpeg-turbo
 * can skip most of that: jpeg_crop_scanline() limits the columns that are reconstructed, and
 * jpeg_skip_scanlines() the rows above and below the rectangle, which are only entropy-decoded (a file
 * damaged or cut short below the rectangle must still be refused as a whole decode refuses it). The
 * caller (packer/image/jpeg_region.py) asks for the rectangle the resize will read plus a margin, so the
 * pixels it reads are those of a whole decode: same library, same accurate integer DCT and smooth
 * ("fancy") upsampling as simplejpeg's defaults.
 *
 * decode(data, gray, scale_denom, left, top, right, bottom, out) -> None
 *   data:         the JPEG file's bytes
 *   gray:         True for 1-channel output (JCS_GRAYSCALE), False for 4-channel RGBX (PIL's RGB layout)
 *   scale_denom:  1, 2, 4 or 8: decode at 1/scale_denom of the stored size (reduced-size inverse DCT)
 *   left..bottom: the rectangle, in pixels of the scaled image
 *   out:          a writable C-contiguous buffer of bytes shaped (height, width, 4), or (height, width) when
 *                 gray, for the scaled image; only the rectangle's rows (and the image's last row), from
 *                 an iMCU boundary at or left of `left`, are written
 * Raises ValueError on any libjpeg error or warning (corrupt data, truncated file), or when the rectangle
 * or the buffer does not fit the scaled image. The GIL is released while libjpeg runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>
#include <jpeglib.h>

#ifndef LIBJPEG_TURBO_VERSION
#error "packer.image._jpeg_region needs libjpeg-turbo (jpeg_crop_scanline, jpeg_skip_scanlines)"
#endif

struct region_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct region_error *err = (struct region_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* A warning (level -1: corrupt or truncated data) is an error here: the caller then decodes the whole
   file the usual way, whose library has the last word on it. Trace messages (level >= 0) are ignored. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) on_error(cinfo);
}

/* Whether `out` is shaped (height, width, channels), or (height, width) for one channel, in bytes. */
static int fits(const Py_buffer *out, JDIMENSION width, JDIMENSION height, int channels) {
    if (out->itemsize != 1 || out->ndim != (channels == 1 ? 2 : 3)) return 0;
    if (out->shape[0] != (Py_ssize_t)height || out->shape[1] != (Py_ssize_t)width) return 0;
    return channels == 1 || out->shape[2] == channels;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    PyObject *out_object;
    int gray, denom, left, top, right, bottom;
    if (!PyArg_ParseTuple(args, "y*piiiiiO", &data, &gray, &denom, &left, &top, &right, &bottom, &out_object))
        return NULL;
    if (PyObject_GetBuffer(out_object, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    struct jpeg_decompress_struct cinfo;
    struct region_error err;
    volatile int failed = 0, misfit = 0;
    const int channels = gray ? 1 : 4;
    memset(&cinfo, 0, sizeof cinfo);
    err.message[0] = 0;
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyErr_Format(PyExc_ValueError, "scale_denom %d is not 1, 2, 4 or 8", denom);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    if (setjmp(err.jump)) {
        failed = 1;
    } else {
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.out_color_space = gray ? JCS_GRAYSCALE : JCS_EXT_RGBX;
        cinfo.scale_num = 1;
        cinfo.scale_denom = denom;
        cinfo.dct_method = JDCT_ISLOW;
        cinfo.do_fancy_upsampling = TRUE;
        jpeg_calc_output_dimensions(&cinfo);  /* checked before jpeg_start_decompress allocates for the image */
        const JDIMENSION width = cinfo.output_width, height = cinfo.output_height;
        if (!fits(&out, width, height, channels) || cinfo.output_components != channels
            || left < 0 || top < 0 || right > (int)width || bottom > (int)height || left >= right
            || top >= bottom) {
            misfit = 1;
        } else {
            jpeg_start_decompress(&cinfo);
            JDIMENSION xoffset = left, columns = right - left;
            if (left > 0 || right < (int)width) jpeg_crop_scanline(&cinfo, &xoffset, &columns);
            if (top > 0) jpeg_skip_scanlines(&cinfo, top);
            unsigned char *base = (unsigned char *)out.buf;
            while (cinfo.output_scanline < (JDIMENSION)bottom) {
                JSAMPROW row = base + ((size_t)cinfo.output_scanline * width + xoffset) * channels;
                jpeg_read_scanlines(&cinfo, &row, 1);
            }
            /* The rows below are entropy-decoded only, to the end of the data, so that a file damaged or
               cut short there is refused as a whole decode refuses it, not accepted because the crop
               drops the damaged part. The last row is read (into its own place in out), because
               libjpeg-turbo skips a skip that reaches the last row without decoding anything. */
            if (cinfo.output_scanline + 1 < height) jpeg_skip_scanlines(&cinfo, height - 1 - cinfo.output_scanline);
            if (cinfo.output_scanline < height) {
                JSAMPROW row = base + ((size_t)cinfo.output_scanline * width + xoffset) * channels;
                jpeg_read_scanlines(&cinfo, &row, 1);
            }
            jpeg_finish_decompress(&cinfo);
        }
    }
    jpeg_destroy_decompress(&cinfo);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (failed) {
        PyErr_Format(PyExc_ValueError, "JPEG region decode failed: %s", err.message);
        return NULL;
    }
    if (misfit) {
        PyErr_SetString(PyExc_ValueError, "the rectangle or the output buffer does not fit the scaled image");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "decode(data, gray, scale_denom, left, top, right, bottom, out): "
                                      "decode one rectangle of a JPEG into out (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg_region", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpeg_region(void) { return PyModule_Create(&module); }
