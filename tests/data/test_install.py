"""mcore-data installs as a distribution, imports, and declares its dependencies as promised."""

from tests._install import check_installed


def test_installed_distribution() -> None:
    check_installed("mcore-data")
