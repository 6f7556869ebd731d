# Packages are discovered (pyproject's packages.find cannot also name a package mapped from elsewhere): every
# lightning_npu* folder, plus csrc/ shipped as the data package lightning_npu._csrc (see pyproject.toml).
from setuptools import find_packages, setup

setup(packages=find_packages(include=["lightning_npu", "lightning_npu.*"]) + ["lightning_npu._csrc"])
