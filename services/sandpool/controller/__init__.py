"""The pool controller and the provider interface it drives."""
