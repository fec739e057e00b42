"""TLS for the tests: a throwaway certificate authority, server certificates,
and stunnel in front of a server or of a client."""

import os
import re
import shutil
import subprocess

from .cleanup import keep_log, register, unregister
from .common import free_port, run_command, spawn_listening, temp_dir

def make_ca(directory, name):
    """A throwaway certificate authority (openssl): (certificate, key) paths."""
    crt, key = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")
    run_command(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                 "ec_paramgen_curve:P-256", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                 "-keyout", key, "-out", crt],
                "openssl req (CA)", timeout=30)
    return crt, key


def make_cert(directory, ca, name, hosts=("localhost", "127.0.0.1"), usage="serverAuth"):
    """A certificate signed by ca for hosts (names and IP addresses in
    subjectAltName), a server's by default, a client's with
    usage="clientAuth": (certificate, key) paths."""
    crt, key = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")
    csr, ext = os.path.join(directory, f"{name}.csr"), os.path.join(directory, f"{name}.ext")
    sans = ",".join(("IP:" if re.fullmatch(r"[0-9.]+", h) else "DNS:") + h for h in hosts)
    with open(ext, "w") as f:
        f.write(f"subjectAltName={sans}\nextendedKeyUsage={usage}\n")
    run_command(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt",
                 "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={hosts[0]}",
                 "-keyout", key, "-out", csr],
                "openssl req (server)", timeout=30)
    run_command(["openssl", "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1],
                 "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", crt],
                "openssl x509 (sign)", timeout=30)
    return crt, key


class Stunnel:
    """stunnel (Debian's stunnel4) on 127.0.0.1, one service, in the foreground.

        Stunnel(server=(crt, key), connect=redis.port)       TLS in, plain out
        Stunnel(client_ca=ca_crt, connect=port, host="localhost")
                                                             plain in, TLS out,
                                                             the peer verified
    .port is where it accepts; its log is kept with the suite's.
    """

    def __init__(self, connect, server=None, client_ca=None, host="localhost"):
        assert (server is None) != (client_ca is None)
        self.connect_port = connect
        self.server = server
        self.client_ca = client_ca
        self.host = host
        self.port = free_port()
        self.dir = None
        self.proc = None

    def __enter__(self):
        register(self)
        try:
            self.dir = temp_dir("outbox-stunnel-")
            conf = os.path.join(self.dir, "stunnel.conf")
            lines = ["foreground = yes", "pid =", f"output = {self.dir}/stunnel.log",
                     "debug = info", "[redis]", f"accept = 127.0.0.1:{self.port}",
                     f"connect = 127.0.0.1:{self.connect_port}"]
            if self.server:
                lines += [f"cert = {self.server[0]}", f"key = {self.server[1]}"]
            else:
                lines += ["client = yes", f"CAfile = {self.client_ca}", "verifyChain = yes",
                          f"checkHost = {self.host}"]
            with open(conf, "w") as f:
                f.write("\n".join(lines) + "\n")
            self.proc = spawn_listening([shutil.which("stunnel4") or "stunnel", conf],
                                        self.port, "stunnel", self.log, cwd=self.dir)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def log(self):
        try:
            with open(os.path.join(self.dir, "stunnel.log"), errors="replace") as f:
                return f.read()
        except (OSError, TypeError):
            return ""

    def close(self):
        unregister(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.dir is not None:
            keep_log(os.path.join(self.dir, "stunnel.log"), "stunnel")
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
