"""Fixtures for the language tests.

The compiler is handed a catalog of what plugins supply. These tests compile
against a hand-made one (:data:`lang_helpers.CATALOG`): a small fake plugin
(tests/lang/fakeplugin) for data sources and optimizers, so the shapes they expect
do not depend on which plugins have landed, and the project's own plugins for eval
passes and storage schemes. The CLI tests run `sexpgpu` with the project's own
plugins.
"""
