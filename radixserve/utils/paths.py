"""Where this package's source lies, for the children a process starts.

A child runs ``python -m radixserve.<...>`` and must import this same copy of
the package (a source checkout need not be installed), so its ``PYTHONPATH``
starts with the folder that holds ``radixserve/``. Computed from this file, not
from ``radixserve.__file__``, so that a module deep in a package need not import
the package's facade (``radixserve/__init__.py`` sits at the top of the layers).
"""

from __future__ import annotations

import os

#: The folder that holds the ``radixserve`` package.
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
