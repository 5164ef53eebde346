"""The one decoding of an image file into the RGB pixels a vision-language model is shown: the trainer's processor
(whose tensors the hf engine takes too), vLLM in process (handed these pixels) and a vLLM server (sent them as a
lossless PNG, never the original file) all see what `decode` gives, so that sampler and trainer see one picture.

It lives here, under every layer, because the data layer (which checks each image at load) and the rollout layer
(which hands the pixels to vLLM) may not import each other; `tandem.data.images` is where rows' images use it."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

# The formats an image may be in: vLLM's own allowlist for untrusted media (vllm.multimodal.image
# .ALLOWED_IMAGE_FORMATS), PIL's names. It leaves out EPS, whose decoding runs Ghostscript on the file's PostScript,
# and WMF, BUFR, GRIB, HDF5 and MPEG, which PIL identifies but cannot decode itself.
FORMATS = ("AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF", "ICNS", "ICO", "IM",
           "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG", "PPM", "PSD", "QOI", "SGI",
           "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB")
# what PIL names some files it opens with one of FORMATS' readers: a JPEG holding a second picture (most phone
# photos) is opened by the JPEG reader as MPO
READ_AS = {"MPO": "JPEG"}

ORIENTATION = 274  # the EXIF tag saying how a camera held the picture
# what brings a picture stored with each orientation upright: ImageOps.exif_transpose's table
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}
TURNED = (5, 6, 7, 8)  # the orientations that swap width and height
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
WHITE = (255, 255, 255)


def allowed(kind: str | None) -> bool:
    """Whether a file PIL names `kind` (its `Image.format`, from any reader) is read: one of FORMATS' readers opens
    it."""
    return READ_AS.get(kind or "", kind) in FORMATS


def open_image(data: bytes) -> Image.Image:
    """The file opened (its header read, no pixels decoded), in one of `FORMATS` only: PIL tries no other reader,
    so an EPS file never reaches Ghostscript."""
    return Image.open(io.BytesIO(data), formats=FORMATS)


def decode(data: bytes) -> Image.Image:
    """An image file's pixels as every consumer takes them, in RGB (8 bits a channel):

    - EXIF orientation applied, as `datasets` (`ImageOps.exif_transpose`), transformers' image loader and vLLM do: a
      phone photo stored sideways is shown upright;
    - transparency (an alpha channel, or a PNG's transparent colour) composited on white, as transformers'
      `convert_to_rgb` and vLLM do, not dropped to whatever colour the transparent pixels hold (black, often);
    - 16-bit greyscale (mode I;16, I) scaled to 8 bits: PIL's RGB holds 8 bits a channel, so a 16-bit value keeps
      its top 8 bits (a plain conversion clips every value over 255, which turns the picture white);
    - palette, greyscale, bilevel, CMYK and the rest as PIL converts them to RGB.

    The result holds no metadata (no EXIF, no transparency key), so a consumer that applies them again changes
    nothing. Raises what PIL raises for a file it cannot decode (OSError, SyntaxError, ValueError, ...)."""
    with open_image(data) as image:
        image.load()
        turn = UPRIGHT.get(orientation(image))
        rgb = _rgb(image)
    if turn is not None:
        rgb = rgb.transpose(turn)
    rgb.info.clear()
    return rgb


def orientation(image: Image.Image) -> int:
    """The EXIF orientation of an opened image (1: stored upright). Malformed EXIF counts as upright, as vLLM takes
    it: the pixels stand as stored."""
    try:
        value = image.getexif().get(ORIENTATION, 1)
    except Exception:  # EXIF is free-form metadata that PIL parses loosely: any failure reads as no orientation
        return 1
    return value if isinstance(value, int) and value in UPRIGHT else 1


def _rgb(image: Image.Image) -> Image.Image:
    if image.mode in ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", image.size, WHITE)
        out.paste(rgba, mask=rgba.getchannel("A"))  # vLLM's rgba_to_rgb
        return out
    if image.mode == "I" or image.mode.startswith("I;16"):
        values = np.asarray(image.convert("I"), dtype=np.int64)  # I;16 as 0..65535 in 32-bit ints
        return Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8)).convert("RGB")
    return image.convert("RGB")


def decoded_size(data: bytes) -> tuple[int, int]:
    """(width, height) of `decode(data)`, from the header and the EXIF orientation (JPEG's is in its header; PIL
    may decode a PNG's pixels to find its EXIF)."""
    with open_image(data) as image:
        width, height = image.size
        return (height, width) if orientation(image) in TURNED else (width, height)


def decoded_png(data: bytes) -> bytes:
    """`decode(data)` as a PNG (lossless, RGB, no metadata): what an engine that decodes files itself (a vLLM server)
    is sent, so that it reads the pixels tandem decoded and no other. Compression level 1: fast, still lossless."""
    out = io.BytesIO()
    decode(data).save(out, format="PNG", compress_level=1)
    return out.getvalue()
