"""Build hook that ships `chatchat_policybert_hook.pth` at the root of site-packages.

Why not `data_files`: that installs into the environment root (e.g. `.venv/`), where the
interpreter never reads `.pth` files. Files that `build_py` writes to the root of `build_lib`
end up at the root of the wheel, i.e. directly in site-packages. For `pip install -e`,
setuptools' editable wheel ignores non-package build outputs, so there the file is written
straight into the unpacked editable wheel (the `install_lib` that `editable_wheel` sets).
The top-level `model_settings.yaml`/`kb_settings.yaml` are copied into the package so that
`chatchat-policybert setup` finds them in a wheel install.
All metadata lives in setup.cfg.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "chatchat_policybert_hook.pth"
# One `import` line: site.py executes it at every interpreter start. install() only adds a
# meta-path finder and never raises; a package that is gone (half-removed install) is skipped
# quietly instead of printing a traceback at every start.
PTH_CONTENT = (
    'import sys; exec("try:\\n from chatchat_policybert.plugin.hook import install\\n'
    'except ModuleNotFoundError:\\n pass\\nelse:\\n install()")\n'
)


# The top-level settings users copy, shipped inside the package for `chatchat-policybert setup`.
SETTINGS_FILES = ("model_settings.yaml", "kb_settings.yaml")
SETTINGS_PACKAGE_DIR = Path("chatchat_policybert", "chatchat_settings")


class build_py_with_pth(build_py):
    """build_py that also emits the start-up hook `.pth` and the shipped settings files."""

    def run(self) -> None:
        super().run()
        target = Path(self._pth_dir(), PTH_NAME)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(PTH_CONTENT, encoding="utf-8")
        if not getattr(self, "editable_mode", False):  # editable: the CLI reads the repository root
            self.mkpath(str(Path(self.build_lib, SETTINGS_PACKAGE_DIR)))
            for name in SETTINGS_FILES:
                self.copy_file(name, str(Path(self.build_lib, SETTINGS_PACKAGE_DIR, name)))

    def _pth_dir(self) -> str:
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib, PTH_NAME)))
            outputs.extend(str(Path(self.build_lib, SETTINGS_PACKAGE_DIR, n)) for n in SETTINGS_FILES)
        return outputs


setup(cmdclass={"build_py": build_py_with_pth})
