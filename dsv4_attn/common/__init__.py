"""Vendor-free core: imports on any machine (torch only; vendor libraries never at import time)."""
