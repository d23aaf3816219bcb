import enum

from torchvision._stub import unavailable


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


decode_jpeg = unavailable("io.decode_jpeg")
decode_image = unavailable("io.decode_image")
