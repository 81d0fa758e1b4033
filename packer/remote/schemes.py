"""What each URL scheme supports, in one table: the source, the errors (and so the
retry policy) and the upload ask it rather than compare scheme names.

Every scheme reads by ranged GETs (one per block or record, packer.remote.source). They
differ in the client fsspec builds (botocore for S3, aiohttp for the web), in how a writer
lists the staging prefixes beside OUT, in whether it can publish at all (a web server takes
no uploads), and in the error codes a store sends for a failure worth retrying. A scheme
not in the table (Azure, any other fsspec backend) gets DEFAULT: read and written through
fsspec's generic calls. docs/remote.md shows the table as markdown_table() prints it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# A URL with one of these is a local path, not a remote dataset.
LOCAL = ("file",)

# HTTP statuses that say "busy or failing, try later": any server may send them.
RETRIED_STATUSES = ("500", "502", "503", "504", "429")
# S3's error codes for the same (botocore ClientError's Error.Code).
S3_RETRIED_CODES = ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestLimitExceeded", "TooManyRequests")

CREDENTIALS_ADVICE = ("access refused{at}: check the credentials (storage_options key/secret, or AWS_ACCESS_KEY_ID/"
                      "AWS_SECRET_ACCESS_KEY/AWS_PROFILE), the endpoint_url, and that they may {verb} this bucket")
WEB_SERVER_ADVICE = ("access refused by the web server (403): check the URL, and that the server lets this machine "
                     "read the file")


@dataclass(frozen=True)
class Scheme:
    """One scheme's row. Connection errors and timeouts are retried on every scheme; retried
    adds the codes a server of this kind sends when trying again can help."""

    name: str
    ranged_reads: bool = True
    # How a writer finds the staging prefixes beside OUT: "delimiter" (one S3 listing call),
    # "glob" (fsspec's), or "" where it cannot list.
    listing: str = "glob"
    # How a write is published whole, or "" where the scheme is read-only.
    publish: str = "server-side copies, packer.json last"
    # The client fsspec builds: "botocore" gets one attempt per request (packer retries),
    # "aiohttp" gets connect and read timeouts.
    client: str = ""
    bucket_check: bool = False  # a HEAD of the bucket before packing
    multipart: bool = False  # uploads take a part size (chunksize)
    names_endpoint: bool = False  # messages say which endpoint refused or did not answer
    retried: tuple[str, ...] = RETRIED_STATUSES
    denied_advice: str = CREDENTIALS_ADVICE  # {at}: " at ENDPOINT" or "", {verb}: read or writ(e)

    @property
    def writable(self) -> bool:
        return bool(self.publish)


S3 = Scheme("s3", listing="delimiter", client="botocore", bucket_check=True, multipart=True, names_endpoint=True,
            retried=S3_RETRIED_CODES + RETRIED_STATUSES)
WEB = Scheme("https", listing="", publish="", client="aiohttp", denied_advice=WEB_SERVER_ADVICE)
DEFAULT = Scheme("*")

SCHEMES = {scheme.name: scheme for scheme in (
    S3,
    replace(S3, name="s3a"),
    Scheme("gs"),
    replace(WEB, name="http"),
    WEB,
)}


def scheme_for(name: str) -> Scheme:
    """The row of a scheme name (lower case, as packer.remote.scheme_of gives it); DEFAULT for
    one the table does not name."""
    return SCHEMES.get(name, DEFAULT)


def named(client: str) -> tuple[str, ...]:
    """The schemes whose fsspec client is client (fsspec's configuration is keyed by them)."""
    return tuple(name for name, scheme in SCHEMES.items() if scheme.client == client)


def retried_codes() -> set[str]:
    """Every code some scheme retries: an error's chain says which store sent it."""
    return {code for scheme in (*SCHEMES.values(), DEFAULT) for code in scheme.retried}


def markdown_table() -> str:
    """The table for docs/remote.md."""
    rows = ["| scheme | ranged reads | listing | publish | client | retried codes (and every connection error or "
            "timeout) |", "| --- | --- | --- | --- | --- | --- |"]
    for scheme in (*SCHEMES.values(), DEFAULT):
        name = "any other fsspec URL" if scheme is DEFAULT else f"`{scheme.name}://`"
        rows.append(f"| {name} | {'yes' if scheme.ranged_reads else 'no'} | {scheme.listing or 'no'} | "
                    f"{scheme.publish or 'read-only'} | {scheme.client or 'fsspec default'} | "
                    f"{', '.join(scheme.retried)} |")
    return "\n".join(rows) + "\n"
