"""The .sx language: reader, forms, the <core> prelude, shape checking and the compiler."""
