"""The tests' own kit: helpers shared by several test modules, so that no test module imports
another. So far: the FlashMLA stand-in (``flashmla_standin``) and the tiny parity matrix
(``parity_tiny``); the step builders, the comparator and the reference helpers are to follow
(issue 25 item 4)."""
