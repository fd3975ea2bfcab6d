"""What the tests, ``dsv4-attn parity`` and ``dsv4-attn bench`` share to draw random steps and to
measure a result against the float64 reference:

- ``steps``   the one step builder (``make_step`` -> ``StepCase``), the top-k drawer the parity
              matrix and the bench draw with too (``fill_topk_prefix``), a stride-keeping cache
              copy (``cache_to``)
- ``errors``  the three error figures (``error_figures``; the tests' strict ``compare``)

Vendor-free and import-safe like ``common/``: it imports torch and ``common/`` only, so the tools
that need it work from an installed wheel. Test doubles (stand-ins for vendor libraries) are not
here: they live in the tests' own kit (``tests/kit/``).
"""
