"""The tests' own kit: what several test modules share, so that no test module imports another
(tests/test_imports.py holds the rule). The step builder and the error figures live in the
package (``dsv4_attn.testing``: parity and the bench use them from a wheel); here:

- ``compare``        the tolerances read from the parity matrix, ``metrics``, ``assert_close``
- ``reference``      hand-written references: e4m3 bytes decoded from their bit fields, FlashMLA's
                     LSE tolerance
- ``steps``          the vendor tests' presets of ``make_step`` (``nvidia_step``, ``aiter_step``)
- ``layers``         one layer of a ``StepCase`` vs the float64 reference (NaN-poisoned output)
- ``garbage``        steps and rows poisoned with every class of garbage index, and their clean twins
- ``flashmla_standin``  FlashMLA's ops as a checked float64 double
- ``vllm_stack``     vLLM's own layers and runner buffers on the CPU (the vLLM / SGLang shim tests)
- ``parity_tiny``    a tiny parity matrix
- ``house_stats``    the house in numbers (``python tests/kit/house_stats.py``)
"""
