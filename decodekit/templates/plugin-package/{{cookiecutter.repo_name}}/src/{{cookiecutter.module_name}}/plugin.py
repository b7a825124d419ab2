"""{{ cookiecutter.description }}"""
{% include "hooks.py.j2" %}
