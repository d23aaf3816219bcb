import enum

from torchvision._stub import unavailable


class InterpolationMode(enum.Enum):  # defined here, as in torchvision; transforms re-exports it
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


pil_to_tensor = unavailable("transforms.functional.pil_to_tensor")
