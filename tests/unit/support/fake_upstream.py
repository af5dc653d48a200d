"""A stand-in 'upstream' module for the registry tests (its names are what patches target)."""


def helper(x):
    return x + 1


class Base:
    def inherited(self):
        return "base"


class Widget(Base):
    factor = 2

    def scale(self, x):
        return x * self.factor

    @staticmethod
    def describe():
        return "widget"

    @classmethod
    def build(cls):
        return cls()


def call_helper_via_module(x):
    # Upstream code that looks the name up at call time, as patched code must be.
    return helper(x)
