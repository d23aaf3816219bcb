from torchvision.transforms import functional  # noqa: F401
from torchvision.transforms.functional import InterpolationMode  # noqa: F401
