"""What every stubbed function does: refuse."""


def unavailable(name: str):
    def function(*args, **kwargs):
        raise NotImplementedError(
            f"torchvision.{name} is a stub (tests/support/torchvision_stub): only SGLang's argument parser runs with it"
        )

    function.__name__ = name.rsplit(".", 1)[-1]
    function.__qualname__ = function.__name__
    return function
