"""This package's version, in the base layer so that any module may name it
(``radixserve/__init__.py`` re-exports it as ``radixserve.__version__``)."""

__version__ = "0.1.0"
